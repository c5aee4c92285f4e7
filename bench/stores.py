"""What the stores this library serves (multiworld.store) cost against torch's own server, the
baseline, measured in the same run on the same machine.

1. A world's formation: --size member processes (default 16) form a gloo world through a store
   that rank 0's process serves (in that process, as a world's rank 0 serves it: ours on a
   Python thread beside the member's own, torch's on its C++ thread), with torch's
   init_process_group and one all-reduce. Every member has imported torch and connected its
   client first; the clock starts when this coordinating process tells them all to go and stops
   at the wall time of the last member's "formed" (after its all-reduce; one machine, one clock).
   --trials times each, fresh processes each trial.
2. Requests: a store served by a process of its own; --clients threads of this process (torch's
   client lets go of the GIL while it waits) each add to a counter and read --keys counters
   (multi_get), the calls a failure detector's tick makes, for --duration-s. Each call's latency
   is from just before the call to just after it returns.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from tests.support import bench_common as common

KINDS = ("torch", "ours")
LOOPBACK = "127.0.0.1"
CONNECT_TIMEOUT = timedelta(seconds=60)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.setting("--size", int, 16, 4, "members of the world formed")
    p.setting("--trials", int, 5, 1, "worlds formed with each kind of store")
    p.setting("--clients", int, 8, 2, "client threads of the request phase")
    p.setting("--keys", int, 16, 4, "counters each multi_get reads")
    p.setting("--duration-s", float, 5.0, 1.0, "seconds of requests with each kind of store")
    p.add_argument("--member", choices=["server", "rank"], help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def serve(kind: str) -> tuple[int, Any]:
    """A store of `kind` in this process: its port, and what keeps it served."""
    if kind == "ours":
        from multiworld.store import server as store_server
        from multiworld.store.rules import WORLD_STORE

        ours = store_server.serve(LOOPBACK, 0, WORLD_STORE)
        return ours.port, ours
    from torch.distributed import TCPStore

    torchs = TCPStore(LOOPBACK, 0, None, True, CONNECT_TIMEOUT, wait_for_workers=False)
    return int(torchs.port), torchs


def server_member(kind: str) -> None:
    port, _held = serve(kind)
    common.emit("serving", port=port)
    for _ in common.commands():
        pass


def rank_member(kind: str, rank: int, size: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    held = None
    if rank == 0:
        port, held = serve(kind)
        common.emit("serving", port=port)
    store = dist.TCPStore(LOOPBACK, port, None, False, CONNECT_TIMEOUT)
    common.emit("ready")
    for _ in common.commands():
        break
    dist.init_process_group("gloo", store=dist.PrefixStore("bench/", store), rank=rank, world_size=size)
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    common.emit("formed", total=float(tensor.item()))
    for _ in common.commands():
        pass
    del held


def formation(args: argparse.Namespace, kind: str) -> float:
    """Seconds from the go to the last member formed."""
    with common.Members(common.program(__file__)) as members:
        first = members.start("rank-0", ["--member", "rank", "--kind", kind, "--rank", "0", "--size", str(args.size)])
        port = first.wait_for("serving")["port"]
        ranks = [first] + [
            members.start(
                f"rank-{r}",
                ["--member", "rank", "--kind", kind, "--rank", str(r), "--size", str(args.size), "--port", str(port)],
            )
            for r in range(1, args.size)
        ]
        for member in ranks:
            member.wait_for("ready")
        go = time.time()
        for member in ranks:
            member.tell({"go": True})
        formed = [member.wait_for("formed") for member in ranks]
        assert all(event["total"] == args.size for event in formed), formed
        return max(event["at"] for event in formed) - go


def requests(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    from torch.distributed import TCPStore

    with common.Members(common.program(__file__)) as members:
        port = members.start("server", ["--member", "server", "--kind", kind]).wait_for("serving")["port"]
        keys = [f"beat/{n}" for n in range(args.keys)]
        setup = TCPStore(LOOPBACK, port, None, False, CONNECT_TIMEOUT)
        for key in keys:
            setup.add(key, 0)
        latencies: dict[str, list[float]] = {"add": [], "multi_get": []}
        lock = threading.Lock()
        start = threading.Barrier(args.clients)

        def client(n: int) -> None:
            store = TCPStore(LOOPBACK, port, None, False, CONNECT_TIMEOUT)
            mine: dict[str, list[float]] = {"add": [], "multi_get": []}
            start.wait()
            end = time.monotonic() + args.duration_s
            while time.monotonic() < end:
                began = time.monotonic()
                store.add(keys[n % len(keys)], 1)
                between = time.monotonic()
                store.multi_get(keys)
                done = time.monotonic()
                mine["add"].append(between - began)
                mine["multi_get"].append(done - between)
            with lock:
                for call, values in mine.items():
                    latencies[call].extend(values)

        threads = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    calls = sum(len(v) for v in latencies.values())
    return {
        "per_s": calls / args.duration_s,
        **{f"{call}_median_s": statistics.median(v) for call, v in latencies.items()},
        **{f"{call}_p99_s": common.p99(v) for call, v in latencies.items()},
    }


def coordinate(args: argparse.Namespace) -> int:
    load = common.machine_load()
    formed = {kind: [formation(args, kind) for _ in range(args.trials)] for kind in KINDS}
    asked = {kind: requests(args, kind) for kind in KINDS}
    spreads = {kind: common.Spread.of(values) for kind, values in formed.items()}
    body = [
        f"1. a gloo world of {args.size} members formed through rank 0's store ({args.trials} trials each):\n"
        + common.table(
            ["store", "min", "median", "max"],
            [[kind, *(common.fmt_s(v) for v in (s.min, s.median, s.max))] for kind, s in spreads.items()],
        ),
        f"2. {args.clients} clients, each an add and a multi_get of {args.keys} counters, {args.duration_s:g} s:\n"
        + common.table(
            ["store", "calls/s", "add median", "add p99", "multi_get median", "multi_get p99"],
            [
                [
                    kind,
                    f"{r['per_s']:.0f}",
                    *(
                        common.fmt_s(r[k])
                        for k in ("add_median_s", "add_p99_s", "multi_get_median_s", "multi_get_p99_s")
                    ),
                ]
                for kind, r in asked.items()
            ],
        ),
    ]
    targets = [
        common.Target("formation median, ours / torch's", spreads["ours"].median / spreads["torch"].median, 1.5, "x"),
        common.Target(
            "multi_get p99, ours / torch's",
            asked["ours"]["multi_get_p99_s"] / asked["torch"]["multi_get_p99_s"],
            3.0,
            "x",
        ),
    ]
    common.report("stores: this library's against torch's own", load, body, targets)
    if args.json:
        common.json_line(
            {
                "size": args.size,
                "formation_s": {kind: s.as_dict() for kind, s in spreads.items()},
                "requests": asked,
                "targets": {t.what: {"value": t.value, "limit": t.limit, "passed": t.passed} for t in targets},
            }
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.member == "server":
        server_member(args.kind)
    elif args.member == "rank":
        rank_member(args.kind, args.rank, args.size, args.port)
    else:
        return coordinate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
