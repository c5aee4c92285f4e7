"""One plain torch.distributed world (`init_process_group`), for contrast with MultiWorld: the
leader (rank 0) receives from every other rank each step. Everyone shares the one world, so one
dead rank takes every other rank down with it.

Without --multihost this spawns --worldsize processes itself; with it, it is the one rank --rank.
Under a MultiWorld manifest (`multiworld.yaml` here: one world) it is the one rank that the
MultiWorld environment names, at that world's rendezvous and backend. A rank that loses the
world says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared module

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import common  # noqa: E402
from multiworld.channels import Channel, open_channel  # noqa: E402
from multiworld.contract import ENV_WORLDS, WorkerEnv, WorkerStatus, store_prefix  # noqa: E402

WORLD = "world"
# When this program was ready, its imports (torch among them) done: its status reports it.
STARTED = datetime.now(timezone.utc)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    common.add_run_flags(parser)
    parser.add_argument("--worldsize", type=common.at_least(int, 2), default=common.WORLD_SIZE,
                        help="ranks in the world")
    parser.add_argument("--multihost", action="store_true",
                        help="run only rank --rank here (start the others on their hosts)")
    parser.add_argument("--rank", type=int, help="this process's rank (with --multihost)")
    parser.add_argument("--timeout", type=common.at_least(float, 0.1), default=30.0,
                        help="seconds an operation may wait for a silent peer")
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.multihost and args.rank is None:
        parser.error("--rank: required with --multihost")
    if args.rank is not None and not 0 <= args.rank < args.worldsize:
        parser.error(f"--rank: must be in [0, {args.worldsize}), got {args.rank}")


def _from_environment(args: argparse.Namespace, parser: argparse.ArgumentParser) -> WorkerEnv:
    """This process is the rank of the one world the MultiWorld environment gives it."""
    try:
        env = WorkerEnv.from_env(os.environ)
    except ValueError as exc:
        parser.error(f"the MultiWorld environment is unusable: {exc}")
    if len(env.worlds) != 1:
        parser.error(f"{ENV_WORLDS}: single_world runs in exactly one world, got {[w.name for w in env.worlds]}")
    world = env.worlds[0]
    args.rank, args.worldsize, args.addr, args.port = world.rank, world.size, world.host, world.port
    args.backend = world.backend
    return env


def _say_joined(env: WorkerEnv) -> Channel:
    """A plain torch.distributed program tells its platform when it holds its world, the one
    thing the MultiWorld library would otherwise report for it (the platform counts the world
    whole from then on); a lost world shows as this process's exit."""
    channel = open_channel(env.table, env.pod)
    channel.start(lambda table: None)
    world = env.worlds[0]
    channel.status(WorkerStatus(pod=env.pod, joined={world.name: world.epoch}, started=STARTED,
                                joined_at={world.name: datetime.now(timezone.utc)}))
    return channel


def _step(rank: int, size: int, step: int, backend: str) -> None:
    device = common.device_for(backend, rank)
    if rank == common.ROOT:
        for peer in range(1, size):
            tensor = torch.zeros(common.TENSOR_LENGTH, device=device)
            dist.recv(tensor, src=peer)
            common.say(f"rank: {rank} received tensor: {tensor} from rank {peer}")
    else:
        tensor = common.example_tensor(WORLD, rank, step, device)
        dist.send(tensor, dst=common.ROOT)
        common.say(f"rank: {rank} sent tensor: {tensor}")


def _rendezvous(rank: int, args: argparse.Namespace, env: WorkerEnv | None) -> None:
    """Join the world through its store, under this epoch's key prefix. Under a MultiWorld a
    world keeps its port across epochs, so a rank 0 that has not noticed the failure yet may
    still serve the previous epoch's store there: without the prefix a new rank would find the
    old epoch's keys and step into the old world in place of the rank it replaces."""
    timeout = timedelta(seconds=args.timeout)
    prefix = env.worlds[0].store_prefix if env is not None else store_prefix(WORLD, 1)
    store = dist.TCPStore(args.addr, args.port, args.worldsize, is_master=rank == common.ROOT, timeout=timeout)
    dist.init_process_group(args.backend, store=dist.PrefixStore(prefix, store), rank=rank,
                            world_size=args.worldsize, timeout=timeout)  # fmt: skip


def run_rank(rank: int, args: argparse.Namespace, env: WorkerEnv | None = None) -> None:
    try:
        _rendezvous(rank, args, env)
    except RuntimeError as exc:  # the store's rank 0 went away (its epoch ended) or never came
        common.say(f"rank: {rank} could not join the world: {exc}")
        os._exit(1)
    channel = _say_joined(env) if env is not None else None
    try:
        for step in range(1, args.steps + 1):
            _step(rank, args.worldsize, step, args.backend)
            common.say(f"done with step: {step}")
            if step < args.steps:
                time.sleep(args.interval)
    except RuntimeError as exc:  # torch's DistBackendError and gloo's errors are RuntimeErrors
        common.say(f"rank: {rank} lost the world: {exc}")
        # A normal exit would wait out the broken group's pending operations.
        os._exit(1)
    dist.destroy_process_group()
    if channel is not None:
        channel.close()


def _spawn_all(args: argparse.Namespace) -> int:
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_rank, args=(rank, args)) for rank in range(args.worldsize)]
    for rank, process in enumerate(processes):
        process.start()
        common.say(f"rank: {rank} runs as pid {process.pid}")
    for process in processes:
        process.join()
    codes = [process.exitcode for process in processes]
    common.say(f"exit codes by rank: {codes}")
    return 0 if all(code == 0 for code in codes) else 1


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    if not args.multihost and ENV_WORLDS in os.environ:
        env = _from_environment(args, parser)
        run_rank(args.rank, args, env)
        return 0
    if args.multihost:
        run_rank(args.rank, args)
        return 0
    return _spawn_all(args)


if __name__ == "__main__":
    sys.exit(main())
