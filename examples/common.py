"""What the MultiWorld examples share: flags, deterministic tensors, world setup and the
per-world step loop. Each example only supplies its step (the operation it shows).

A program is in its worlds either from `--worldinfo W,R` flags (world `world<W>`, rank R,
rendezvous at `--addr`:`--port`+W) or, given no `--worldinfo`, from the MultiWorld contract
environment (`multiworld.init_from_env()`), where it also follows the live world table.

Every world runs in its own asyncio task, so a broken world never stalls the others. Exit
status: 1 when every world of the process broke, else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import logging
import os
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence

import torch

import multiworld as mw
from multiworld import World, WorldAssignment, WorldBrokenError, WorldManager
from multiworld.contract import WorkerEnv

WORLD_SIZE = 3
TENSOR_LENGTH = 3
DEFAULT_PORT = 29500
ROOT = 0  # the leader: source or destination of the rooted collectives

StepFn = Callable[[World, int], Awaitable[None]]


def say(line: str) -> None:
    """One output line in one write (processes sharing a pipe never split each other's lines),
    flushed so that a reader of the pipe sees it at once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(backend: str, rank: int) -> torch.device:
    """The device of rank `rank`'s tensors: its own GPU (ranks share GPUs round-robin) for nccl."""
    if backend == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


# This process's GPU for its nccl worlds: CUDA devices are per process, so it is chosen once,
# before any world is joined, and handed to the WorldManager.
_cuda_device: torch.device | None = None


def choose_cuda_device(backends: Sequence[str], rank_hint: int) -> torch.device | None:
    """cuda:LOCAL_RANK (else cuda:`rank_hint`) when any world of the process uses nccl."""
    global _cuda_device
    if "nccl" in backends:
        _cuda_device = device_for("nccl", int(os.environ.get("LOCAL_RANK", rank_hint)))
    return _cuda_device


def world_device(world: World) -> torch.device:
    if world.backend == "nccl":
        assert _cuda_device is not None, "choose_cuda_device() runs before any world is joined"
        return _cuda_device
    return torch.device("cpu")


def example_tensor(world: str, rank: int, step: int, device: torch.device) -> torch.Tensor:
    """The tensor rank `rank` of `world` contributes at `step`: small random integers, seeded by
    (world, rank, step) so that every process (and a test) can tell what any rank holds."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{world}/{rank}/{step}".encode()))
    values = torch.randint(1, 7, (TENSOR_LENGTH,), generator=generator).float()
    return values.to(device)


def own_tensor(world: World, step: int) -> torch.Tensor:
    return example_tensor(world.name, world.rank, step, world_device(world))


def empty_tensor(world: World) -> torch.Tensor:
    """A buffer shaped like every rank's tensor, for receiving into."""
    return torch.empty(TENSOR_LENGTH, device=world_device(world))


# ---- flags -------------------------------------------------------------------------------


def at_least(convert: Callable[[str], float], low: float) -> Callable[[str], float]:
    """An argparse type: `convert`, then refuse values below `low`."""
    def parse(text: str) -> float:
        value = convert(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value
    parse.__name__ = convert.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {text}")
    return value


def _world_info(text: str) -> tuple[int, int]:
    """`W,R`: world index W >= 1 and rank R >= 0."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected WORLD,RANK (two integers, e.g. 1,0), got {text!r}")
    index, rank = (int(p) for p in parts)
    if index < 1:
        raise argparse.ArgumentTypeError(f"the world index must be >= 1, got {text!r}")
    return index, rank


def add_connection_flags(parser: argparse.ArgumentParser, port_help: str) -> None:
    """--backend, --addr and --port: where and how a process meets its worlds' peers."""
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=default_backend(),
                        help="communication backend (default: nccl when CUDA is available, else gloo)")
    parser.add_argument("--addr", default="127.0.0.1", help="address of the rendezvous host (rank 0)")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT, help=port_help)


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of every step-loop example, the single-world one included."""
    add_connection_flags(parser, "rendezvous port (with --worldinfo W,R: world W uses PORT+W)")
    parser.add_argument("--steps", type=at_least(int, 1), default=100, help="how many steps to run")
    parser.add_argument("--interval", type=at_least(float, 0), default=1.0,
                        help="seconds to sleep between steps")


def build_parser(description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    add_run_flags(parser)
    parser.add_argument("--worldinfo", type=_world_info, action="append", default=[], metavar="W,R",
                        help="join world<W> as rank R (repeatable); "
                             "without it the worlds come from the MULTIWORLD_* environment")
    parser.add_argument("--worldsize", type=at_least(int, 2), default=WORLD_SIZE,
                        help="ranks per world with --worldinfo (default 3)")
    return parser


def assignments_from_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[WorldAssignment]:
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("--backend nccl: no CUDA device here; use --backend gloo")
    indices = [index for index, _ in args.worldinfo]
    if len(set(indices)) != len(indices):
        parser.error(f"--worldinfo: a world index appears twice in {indices}")
    assignments = []
    for index, rank in args.worldinfo:
        if rank >= args.worldsize:
            parser.error(f"--worldinfo {index},{rank}: rank must be below --worldsize {args.worldsize}")
        if args.port + index > 65535:
            parser.error(f"--port {args.port} + world index {index} is not a TCP port")
        assignments.append(WorldAssignment(
            name=f"world{index}", rank=rank, size=args.worldsize, host=args.addr,
            port=args.port + index, epoch=1, backend=args.backend,
        ))
    return assignments


# ---- where worlds come from --------------------------------------------------------------


class WorldSource:
    """Worlds given once (by `--worldinfo`, or by an environment without a live table): joined
    at start, dropped when they break."""

    # How long closing waits, in all, for the worlds' communicators to be released.
    RELEASE_GRACE = 2.0

    def __init__(self, manager: WorldManager, assignments: Sequence[WorldAssignment]) -> None:
        self.manager = manager
        self._assignments = {a.name: a for a in assignments}
        self._handed_out: list[World] = []

    def _hand_out(self, world: World) -> World:
        self._handed_out.append(world)
        return world

    def names(self) -> list[str]:
        return list(self._assignments)

    @property
    def assignments(self) -> list[WorldAssignment]:
        return list(self._assignments.values())

    async def first(self, name: str) -> World:
        return self._hand_out(await self.manager.join_async(self._assignments[name]))

    async def after_break(self, name: str, epoch: int, *, through_removal: bool = False) -> World | None:
        """The world to go on with after `epoch` broke; None to stop using it. through_removal:
        a world that leaves the world table may come back (a world waiting out its restart
        backoff is out of the table meanwhile), so go on waiting for it."""
        return None

    def removed(self, name: str) -> bool:
        """Whether the world left the world table (then its loop ends, and that is no failure)."""
        return False

    def finished(self, name: str) -> None:
        """Every step is done: release the world now rather than at exit, so that the peers
        leaving it are no news to a process still busy in its other worlds."""
        self.manager.leave(name)

    def close(self) -> None:
        self.manager.close()
        # The manager releases a world it left (on purpose or for the table) on a background
        # thread, and close() does not wait for those: exiting under such a thread aborts the
        # process.
        deadline = time.monotonic() + self.RELEASE_GRACE
        for world in self._handed_out:
            world.wait_released(max(0.0, deadline - time.monotonic()))


class LiveWorldSource(WorldSource):
    """Worlds of the contract environment, following the live table: a broken world is taken
    up again at its next epoch; a world whose table entry is removed ends."""

    # wait_world() goes on waiting for a world that left the table, so the wait looks up, this
    # often, whether the manager still has the world at all.
    REMOVAL_CHECK = 1.0

    async def first(self, name: str) -> World:
        return self._hand_out(await self.manager.wait_world(name))

    async def after_break(self, name: str, epoch: int, *, through_removal: bool = False) -> World | None:
        while through_removal or not self.removed(name):
            try:
                return self._hand_out(
                    await self.manager.wait_world(name, newer_than=epoch, timeout=self.REMOVAL_CHECK)
                )
            except TimeoutError:
                pass
        return None

    def removed(self, name: str) -> bool:
        try:
            self.manager.world(name)  # a broken incarnation stays until a newer one or removal
        except mw.UnknownWorldError:
            return True
        return False


def worker_env(parser: argparse.ArgumentParser, flag: str) -> WorkerEnv:
    """The MultiWorld contract environment of a process given no `flag`."""
    try:
        return WorkerEnv.from_env(os.environ)
    except ValueError as exc:
        parser.error(f"no {flag} given, and the MultiWorld environment is unusable: {exc}")


def source_from_env(parser: argparse.ArgumentParser, env: WorkerEnv | None = None) -> WorldSource:
    """The worlds of the contract environment (`env`, else read here)."""
    env = env if env is not None else worker_env(parser, "--worldinfo")
    # A warm spare learns its worlds only once it plays a member pod: it takes its GPU now,
    # when it has one (a pod of a GPU member's template).
    backends = ["nccl"] if env.spare and torch.cuda.is_available() else [a.backend for a in env.worlds]
    device = choose_cuda_device(backends, rank_hint=0)
    # Each world is taken up as soon as it forms (drive_world waits for it): waiting here for
    # every world would keep this process out of the worlds that formed while another waits
    # for a peer, and their ops would wait on it until their op timeout.
    manager = mw.init_from_env(device=device, wait=False)
    # A spare returns from init_from_env in the worlds of the member pod it plays.
    assignments = env.worlds or list(manager.assignments().values())
    # Without a table channel the start-up worlds are final: nothing would ever rebuild them.
    source_type = LiveWorldSource if env.table else WorldSource
    return source_type(manager, assignments)


def source_from_assignments(assignments: Sequence[WorldAssignment], backend: str, rank_hint: int) -> WorldSource:
    """Worlds given once, on the command line. rank_hint: this process's GPU for nccl."""
    device = choose_cuda_device([backend], rank_hint=rank_hint)
    manager = WorldManager(pod=f"{os.uname().nodename}-{os.getpid()}", device=device)
    return WorldSource(manager, assignments)


def source_from_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> WorldSource:
    assignments = assignments_from_flags(args, parser)
    # As in the seed, rank R of every world uses GPU R.
    return source_from_assignments(assignments, args.backend, rank_hint=assignments[0].rank)


# ---- the step loop -----------------------------------------------------------------------


class Outcome(enum.Enum):
    FINISHED = "finished"
    ENDED = "ended"  # removed from the world table: not a failure
    BROKEN = "broken"


async def agree_on_step(world: World, number: int) -> int:
    """The step a (re)built world goes on from: the furthest any member has reached, since a
    replaced member starts again from step 1 while the survivors go on."""
    furthest = torch.tensor([number], dtype=torch.int64, device=world_device(world))
    await world.all_reduce(furthest, op=mw.ReduceOp.MAX, async_op=True)
    return int(furthest.item())


async def drive_world(source: WorldSource, name: str, step: StepFn, steps: int, interval: float) -> Outcome:
    """Run `steps` steps in one world; after a break, go on in the rebuilt world when the
    source has one."""
    try:
        world: World | None = await source.first(name)
    except mw.MultiWorldError as exc:  # a failed rendezvous ends this world only
        say(f"{name} failed to join: {exc}")
        return Outcome.BROKEN
    number, agreed = 1, False
    while world is not None and number <= steps:
        try:
            if not agreed:
                number, agreed = await agree_on_step(world, number), True
            await step(world, number)
        except WorldBrokenError as exc:
            if source.removed(name):
                break
            say(f"{name} broke: {exc.reason}")
            world, agreed = await source.after_break(name, exc.epoch), False
            if world is not None:
                say(f"{name} rejoined at epoch {world.epoch}")
            continue
        say(f"done with step: {number}")
        number += 1
        if number <= steps:
            await asyncio.sleep(interval)
    if world is None or number <= steps:
        if source.removed(name):
            say(f"{name} ended: removed from the world table")
            return Outcome.ENDED
        return Outcome.BROKEN
    await leave_together(world)
    source.finished(name)
    return Outcome.FINISHED


async def leave_together(world: World) -> None:
    """Nobody leaves while a peer may still need it to finish the last step."""
    try:
        await world.barrier(async_op=True)
    except WorldBrokenError:
        pass  # a peer gone right after its last step: every step is done all the same


async def _run(source: WorldSource, step: StepFn, steps: int, interval: float) -> int:
    try:
        outcomes = await asyncio.gather(
            *(drive_world(source, name, step, steps, interval) for name in source.names())
        )
    finally:
        source.close()
    if outcomes and all(o is Outcome.BROKEN for o in outcomes):
        say("every world broke: exiting with status 1")
        return 1
    return 0


def configure_logging(parser: argparse.ArgumentParser) -> None:
    """The examples print their own line for every break; the library's logs are there on
    request (MULTIWORLD_LOG_LEVEL)."""
    level = os.environ.get("MULTIWORLD_LOG_LEVEL", "ERROR").upper()
    if not isinstance(logging.getLevelName(level), int):
        parser.error(f"MULTIWORLD_LOG_LEVEL={level!r} is not a log level (DEBUG, INFO, WARNING, ERROR)")
    logging.basicConfig(level=level)


def run_example(step: StepFn, description: str | None = None, argv: Sequence[str] | None = None) -> int:
    """Parse the flags, take the worlds, drive each one with `step`; returns the exit status."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    configure_logging(parser)
    source = source_from_flags(args, parser) if args.worldinfo else source_from_env(parser)
    return asyncio.run(_run(source, step, args.steps, args.interval))


def main(step: StepFn, description: str | None = None) -> None:
    sys.exit(run_example(step, description))
