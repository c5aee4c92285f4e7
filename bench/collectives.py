"""Collective ops through multiworld against the same ops called on the raw torch ProcessGroupGloo.

Three member processes (gloo over loopback) each join one multiworld World. The raw column calls
the same op directly on the torch ProcessGroupGloo that the World holds (the library builds a
plain one), so both columns share the communicator, its sockets and its threads, and only the
library's own code differs. Comparing two different communicators instead measures where the
scheduler put each one's threads: on two cores that alone moved ratios by +-10 % from run to run.
The `communicator` row shows that: a raw all_reduce on the World's communicator against one on a
ProcessGroupGloo built by hand in the same processes; a library that built a slower communicator
would show there, beyond that noise.

Both columns run in the same processes, alternating op by op, so that drift in the machine's
load hits both alike, in rounds of a few pairs; every other round runs the raw op first. An op's
time is the slowest rank's; each pair of adjacent ops yields a ratio library/raw, and the
reported ratio is the median of those ratios (times: the medians over all ops), with its bootstrap
standard error (resampling rounds): at 8 s per cell about 0.01 for the collectives from 1 MiB up,
where three busy processes share two cores, and 0.003 for send_recv, so cells from 1 MiB up
measure 2.5 times as long (20 s by default: about 0.006). send_recv is one
ping-pong between ranks 0 and 1 (rank 2 idles); all_reduce_async is `await world.all_reduce(...,
async_op=True)` on an event loop, against the raw work's torch future bridged into the same loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tests.support import bench_common as common

OPS = ("all_reduce", "all_reduce_async", "all_gather", "broadcast", "send_recv")
# A raw all_reduce on the World's communicator against one on a ProcessGroupGloo built by hand.
COMMUNICATOR = "communicator"
# The noise floor of the method: the raw all_reduce against itself.
CONTROL = "control"
CELLS = (*OPS, COMMUNICATOR, CONTROL)
SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
QUICK_SIZES = (4 << 10, 1 << 20)
RANKS = 3
# Targets on the cell's ratio library/raw (the median over pairs of adjacent ops).
LARGE_FROM = 1 << 20
LARGE_LIMIT = 1.02
# Cells from LARGE_FROM up measure this many times the budget: their target is the tightest, and
# three busy processes on two cores make them the noisiest (standard error about 0.01 at 8 s).
LARGE_BUDGET_FACTOR = 2.5
SMALL_SIZE = 4 << 10
SMALL_LIMIT = 1.10
# A round alternates library and raw op by op (so that drift in the machine's load hits both
# alike), this many pairs of them: each implementation's share lasts about ROUND_S, and a
# round's median needs a few ops.
ROUND_S = 0.03
MAX_PAIRS_PER_ROUND = 20
MIN_PAIRS_PER_ROUND = 3
WARMUP_OPS = 3
# Resamples for the standard error of a cell's ratio.
BOOTSTRAP = 200

Op = Callable[[], Awaitable[None]]


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.setting(
        "--budget",
        float,
        8.0,
        0.2,
        f"seconds of measuring per op and size, {LARGE_BUDGET_FACTOR:g} times that from {LARGE_FROM >> 20} MiB up",
    )
    p.setting("--min-rounds", int, 8, 3, "rounds per op and size at the least")
    p.add_argument(
        "--sizes",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=None,
        help="comma-separated tensor sizes in bytes (default 4K,64K,1M,4M,16M)",
    )
    p.add_argument(
        "--ops",
        type=lambda s: tuple(s.split(",")),
        default=OPS,
        help=f"comma-separated ops to measure (default all: {','.join(OPS)}); "
        f"{COMMUNICATOR} and {CONTROL} are always measured",
    )
    p.add_argument("--member", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ports", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    unknown = set(args.ops) - set(OPS)
    if unknown:
        p.error(f"--ops: unknown op(s) {', '.join(sorted(unknown))}; choose from {', '.join(OPS)}")
    if any(s <= 0 or s % 4 for s in args.sizes):
        p.error(f"--sizes: every size must be a positive multiple of 4 bytes (float32), got {args.sizes}")
    return args


def cell_budget(size: int, budget: float) -> float:
    return budget * LARGE_BUDGET_FACTOR if size >= LARGE_FROM else budget


# ---- the member side -------------------------------------------------------------------------


def awaitable(torch_work: Any) -> Any:
    """A raw work as an asyncio future: its torch future's done-callback wakes the loop (the
    cheapest bridge measured, see shared/research/torch-worlds.md)."""
    import asyncio

    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def wake(_: Any) -> None:
        loop.call_soon_threadsafe(settle)

    torch_work.get_future().add_done_callback(wake)
    return done


class Bench:
    """Both implementations of every op in one member process."""

    def __init__(self, rank: int, lib_port: int, own_port: int) -> None:
        from datetime import timedelta

        import torch
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        import multiworld as mw

        torch.set_num_threads(1)
        self.torch = torch
        self.rank = rank
        # Detection as shipped (the heartbeat's cost is its interval), but a loaded machine must
        # not break the world in the middle of a measurement.
        config = mw.DetectConfig(dead_after=30.0, op_timeout=600.0, join_timeout=120.0)
        self.manager = mw.WorldManager(pod=f"bench-{rank}", config=config)
        self.world = self.manager.join(
            mw.WorldAssignment(name="bench", rank=rank, size=RANKS, host="127.0.0.1", port=lib_port)
        )
        # The World's own torch ProcessGroupGloo, called directly: the raw column. (Any: torch's
        # stubs omit a backend's ops, which are bound in C++.)
        self.raw: Any = self.world.communicator
        # One built by hand, on a store of its own: the communicator row, and the plumbing that
        # agrees on a plan and gathers the timings outside the measurement.
        self._store = TCPStore("127.0.0.1", own_port, RANKS, rank == 0, timedelta(seconds=120))
        self.own: Any = ProcessGroupGloo(PrefixStore("own/", self._store), rank, RANKS, timedelta(seconds=600))

    def ops(self, kind: str, size: int) -> tuple[Op, Op]:
        """(library, raw) for one op on `size` bytes of float32."""
        torch, w, raw = self.torch, self.world, self.raw
        t = torch.ones(size // 4)
        if kind == "all_reduce":

            async def lib_op() -> None:
                w.all_reduce(t)

            async def raw_op() -> None:
                raw.allreduce([t]).wait()

            return lib_op, raw_op
        if kind in (COMMUNICATOR, CONTROL):
            own = self.own if kind == COMMUNICATOR else raw

            async def lib_op() -> None:
                own.allreduce([t]).wait()

            async def raw_op() -> None:
                raw.allreduce([t]).wait()

            return lib_op, raw_op
        if kind == "all_reduce_async":

            async def lib_op() -> None:
                work = w.all_reduce(t, async_op=True)
                assert work is not None  # async_op=True returns the op's Work
                await work

            async def raw_op() -> None:
                await awaitable(raw.allreduce([t]))

            return lib_op, raw_op
        if kind == "all_gather":
            outs = [torch.empty_like(t) for _ in range(RANKS)]

            async def lib_op() -> None:
                w.all_gather(outs, t)

            async def raw_op() -> None:
                raw.allgather([outs], [t]).wait()

            return lib_op, raw_op
        if kind == "broadcast":

            async def lib_op() -> None:
                w.broadcast(t, src=0)

            async def raw_op() -> None:
                raw.broadcast([t]).wait()

            return lib_op, raw_op
        if kind == "send_recv":
            return self._ping_pong(t)
        raise ValueError(f"unknown op {kind!r}")

    def _ping_pong(self, t: Any) -> tuple[Op, Op]:
        w, raw = self.world, self.raw
        if self.rank == 0:

            async def lib_op() -> None:
                w.send(t, 1)
                w.recv(t, 1)

            async def raw_op() -> None:
                raw.send([t], 1, 0).wait()
                raw.recv([t], 1, 0).wait()
        elif self.rank == 1:

            async def lib_op() -> None:
                w.recv(t, 0)
                w.send(t, 0)

            async def raw_op() -> None:
                raw.recv([t], 0, 0).wait()
                raw.send([t], 0, 0).wait()
        else:

            async def lib_op() -> None:
                return None

            raw_op = lib_op
        return lib_op, raw_op

    async def _times(self, op: Op, count: int) -> list[float]:
        from time import perf_counter

        out = []
        for _ in range(count):
            start = perf_counter()
            await op()
            out.append(perf_counter() - start)
        return out

    async def _alternate(self, first: Op, second: Op, times: Any, first_column: int) -> None:
        """Run `first` and `second` alternately, one pair per row of `times` (columns: library,
        raw; `first` goes into `first_column`)."""
        from time import perf_counter

        for row in times:
            start = perf_counter()
            await first()
            middle = perf_counter()
            await second()
            end = perf_counter()
            row[first_column], row[1 - first_column] = middle - start, end - middle

    def _agree(self, ops_per_round: int, rounds: int) -> tuple[int, int]:
        """Rank 0's plan for this cell, for every rank (raw broadcast: outside the measurement)."""
        plan = self.torch.tensor([ops_per_round, rounds], dtype=self.torch.int64)
        self.own.broadcast([plan]).wait()
        return int(plan[0]), int(plan[1])

    async def cell(self, kind: str, size: int, budget: float, min_rounds: int) -> dict[str, Any]:
        budget = cell_budget(size, budget)
        lib_op, raw_op = self.ops(kind, size)
        await self._times(lib_op, WARMUP_OPS)
        warm = max(statistics.median(await self._times(raw_op, WARMUP_OPS)), 1e-6)
        per_round = max(MIN_PAIRS_PER_ROUND, min(MAX_PAIRS_PER_ROUND, int(ROUND_S / warm)))
        rounds = max(min_rounds, int(budget / (2 * per_round * warm)))
        rounds += rounds % 2  # whole pairs of rounds
        per_round, rounds = self._agree(per_round, rounds)
        # Per round, pair and implementation, this rank's op time (columns: library, raw). Every
        # other round runs the raw op first, so that going first or second cancels out.
        times = self.torch.zeros(rounds, per_round, 2, dtype=self.torch.float64)
        for i in range(rounds):
            if i % 2 == 0:
                await self._alternate(lib_op, raw_op, times[i], 0)
            else:
                await self._alternate(raw_op, lib_op, times[i], 1)
        slowest = self._slowest(times)
        lib, raw = slowest[..., 0], slowest[..., 1]
        # Each pair of adjacent ops gives a ratio; its median is the cell's ratio.
        ratios = lib / raw
        return {
            "op": kind,
            "bytes": size,
            "lib_s": lib.median().item(),
            "raw_s": raw.median().item(),
            "ratio": ratios.median().item(),
            "se": self._standard_error(ratios),
            "rounds": rounds,
            "per_round": per_round,
        }

    def _standard_error(self, ratios: Any) -> float:
        """The bootstrap standard error of the median ratio, resampling whole rounds (ops of
        one round share the machine's state): how far from the truth a cell's ratio may be."""
        torch = self.torch
        generator = torch.Generator().manual_seed(0)
        rounds = ratios.shape[0]
        picks = torch.randint(0, rounds, (BOOTSTRAP, rounds), generator=generator)
        medians = ratios[picks].reshape(BOOTSTRAP, -1).median(dim=1).values
        return medians.std().item()

    def _slowest(self, times: Any) -> Any:
        """Per op, the slowest rank's time (a root or an idle rank finishes early). The gather
        also keeps every rank in the same cell."""
        every = [self.torch.empty_like(times) for _ in range(RANKS)]
        self.own.allgather([every], [times]).wait()
        return self.torch.stack(every).amax(dim=0)

    async def run(
        self, ops: Sequence[str], sizes: Sequence[int], budget: float, min_rounds: int
    ) -> list[dict[str, Any]]:
        return [
            await self.cell(kind, size, budget, min_rounds) for size in sizes for kind in (*ops, COMMUNICATOR, CONTROL)
        ]

    def close(self) -> None:
        self.own.barrier().wait()
        self.manager.close()


def member(args: Any) -> None:
    import asyncio

    lib_port, own_port = (int(p) for p in args.ports.split(","))
    bench = Bench(args.member, lib_port, own_port)
    common.emit("joined", rank=args.member)
    cells = asyncio.run(bench.run(args.ops, args.sizes, args.budget, args.min_rounds))
    if args.member == 0:
        common.emit("results", cells=cells)
    bench.close()


# ---- the coordinator -------------------------------------------------------------------------


def targets(cells: list[dict[str, Any]]) -> list[common.Target]:
    out = []
    for c in cells:
        if c["op"] in (COMMUNICATOR, CONTROL):
            continue
        label = f"{c['op']} {common.fmt_bytes(c['bytes'])} ratio"
        if c["bytes"] >= LARGE_FROM:
            out.append(common.Target(label, c["ratio"], LARGE_LIMIT))
        elif c["bytes"] == SMALL_SIZE:
            out.append(common.Target(label, c["ratio"], SMALL_LIMIT))
    return out


def render(cells: list[dict[str, Any]]) -> str:
    rows = [
        [
            c["op"],
            common.fmt_bytes(c["bytes"]),
            common.fmt_s(c["lib_s"]),
            common.fmt_s(c["raw_s"]),
            f"{c['ratio']:.3f}",
            f"{c['se']:.3f}",
            f"{c['rounds']}x{c['per_round']}",
        ]
        for c in sorted(cells, key=lambda c: (CELLS.index(c["op"]), c["bytes"]))
    ]
    note = (
        f"{COMMUNICATOR}: a raw all_reduce on a ProcessGroupGloo built by hand (library column) against one "
        "on the World's\n  (raw column): no target; beyond the noise of where the scheduler put the threads, it "
        "would show a slower communicator\n"
        f"{CONTROL}: the raw all_reduce in both columns: the noise floor of this run (a ratio further from 1 "
        "than it is not resolved)\n"
        "se: the bootstrap standard error of the ratio (resampling rounds)"
    )
    return common.table(
        ["op", "size", "library (median)", "raw gloo (median)", "ratio lib/raw", "se", "rounds"], rows
    ) + ("\n" + note)


def coordinate(args: Any) -> int:
    load = common.machine_load()
    lib_port, own_port = common.free_ports(2)
    script = common.program(__file__)
    flags = ["--ports", f"{lib_port},{own_port}", "--budget", str(args.budget), "--min-rounds", str(args.min_rounds),
             "--sizes", ",".join(map(str, args.sizes)), "--ops", ",".join(args.ops)]  # fmt: skip
    wait = 120.0 + sum((len(args.ops) + 2) * (cell_budget(size, args.budget) * 3 + 10) for size in args.sizes)
    with common.Members(script) as members:
        ranks = [members.start(f"rank{r}", ["--member", str(r), *flags]) for r in range(RANKS)]
        cells = ranks[0].wait_for("results", timeout=wait)["cells"]
        for m in ranks:
            m.proc.wait(60)
    found = targets(cells)
    common.report(
        f"collectives: multiworld vs raw ProcessGroupGloo, {RANKS} ranks, gloo on loopback",
        load,
        [render(cells)],
        found,
    )
    if args.json:
        ratios: dict[str, dict[str, float]] = {}
        errors: dict[str, dict[str, float]] = {}
        for c in cells:
            if c["op"] in OPS:
                ratios.setdefault(c["op"], {})[str(c["bytes"])] = c["ratio"]
                errors.setdefault(c["op"], {})[str(c["bytes"])] = c["se"]
        common.json_line({"collectives": {"ratios": ratios, "standard_errors": errors}})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.member is not None:
        member(args)
        return 0
    return coordinate(args)


if __name__ == "__main__":
    sys.exit(main())
