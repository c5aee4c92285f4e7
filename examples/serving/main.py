"""Model serving across fault-isolated worlds (the seed's resnet example): a router (rank 0)
sends a stream of inference requests, synthetic image batches, to replicas that each run a
small ResNet-style CNN; every replica is in a world of its own with the router. A replica that
dies costs only its world: the router re-sends what it held to the others, and uses it again
when its world comes back at a new epoch.

With --rank, replica K (1..--num_workers) is rank 1 of world<K>, the router rank 0 of each,
with the rendezvous at --addr:--port+K. Without --rank, the worlds come from the MultiWorld
environment (`multiworld run`, the operator): the router is rank 0 of all its worlds, a replica
rank 1 of its one world.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared module

import common  # noqa: E402
import torch  # noqa: E402
import wire  # noqa: E402
from replica import run_replica  # noqa: E402
from router import Router, Settings  # noqa: E402

from multiworld import WorldAssignment  # noqa: E402
from multiworld.contract import ENV_WORLDS  # noqa: E402


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be in 0..2**32-1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_connection_flags(parser, "rendezvous port base: replica K's world uses PORT+K")
    parser.add_argument("--rank", type=common.at_least(int, 0),
                        help="0: the router; K in 1..--num_workers: replica K "
                             "(without it the worlds come from the MULTIWORLD_* environment)")
    parser.add_argument("--num_workers", type=common.at_least(int, 1), default=2,
                        help="replicas, with --rank (default 2)")
    parser.add_argument("--requests", type=common.at_least(int, 1), default=1000,
                        help="requests the router serves before it stops the replicas (default 1000)")
    parser.add_argument("--rate", type=common.at_least(float, 0), default=100.0,
                        help="requests per second arriving at the router; 0: as fast as the replicas answer "
                             "(default 100)")
    parser.add_argument("--seed", type=_seed, default=0,
                        help="seed of the model's weights and the request images (0 to 2**32-1); "
                             "the same in every process")
    parser.add_argument("--check-every", type=common.at_least(int, 1), default=10,
                        help="the router checks the answer of every N-th request against the model (default 10)")
    parser.add_argument("--trace", type=Path,
                        help="the router writes every request's times and every failure as JSON lines here")
    return parser


def checked_trace(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse a --trace file that cannot be written before any world is joined."""
    if args.trace is None:
        return
    try:
        args.trace.open("a").close()
    except OSError as exc:
        parser.error(f"--trace: cannot write {args.trace}: {exc.strerror}")


def assignments_from_rank(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[WorldAssignment]:
    """--rank 0: rank 0 of world1..world<N>; --rank K: rank 1 of world<K>."""
    workers = args.num_workers
    if args.rank > workers:
        parser.error(f"--rank: must be 0 (the router) or a replica in 1..{workers} (--num_workers {workers}), "
                     f"got {args.rank}")
    if args.port + workers > 65535:
        parser.error(f"--port {args.port} + --num_workers {workers} is not a TCP port")
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("--backend nccl: no CUDA device here; use --backend gloo")
    replicas = range(1, workers + 1) if args.rank == 0 else [args.rank]
    rank = wire.ROUTER if args.rank == 0 else wire.REPLICA
    return [WorldAssignment(name=f"world{k}", rank=rank, size=wire.WORLD_SIZE, host=args.addr, port=args.port + k,
                            epoch=1, backend=args.backend) for k in replicas]


def is_router(worlds: Sequence[WorldAssignment], parser: argparse.ArgumentParser) -> bool:
    """The router is rank 0 of each of its worlds, a replica rank 1 of its one world; every
    world holds the two."""
    shape = {w.name: (w.rank, w.size) for w in worlds}
    if worlds and all(size == wire.WORLD_SIZE for _, size in shape.values()):
        if all(rank == wire.ROUTER for rank, _ in shape.values()):
            return True
        if len(worlds) == 1 and worlds[0].rank == wire.REPLICA:
            return False
    parser.error(f"{ENV_WORLDS}: a serving process is the router (rank 0 of each of its worlds) or a replica "
                 f"(rank 1 of one world), in worlds of 2 ranks; got (rank, size) by world: {shape}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    common.configure_logging(parser)
    checked_trace(args, parser)
    if args.rank is not None:
        worlds = assignments_from_rank(args, parser)
        router = is_router(worlds, parser)
        source = common.source_from_assignments(worlds, args.backend, rank_hint=args.rank)
    else:
        env = common.worker_env(parser, "--rank")
        # A warm spare has no worlds until it plays a pod: it learns its part in source_from_env.
        router = env.spare == "" and is_router(env.worlds, parser)
        source = common.source_from_env(parser, env)
        if env.spare:
            router = is_router(source.assignments, parser)
    if not router:
        return asyncio.run(run_replica(source, args.seed))
    settings = Settings(requests=args.requests, rate=args.rate, seed=args.seed, check_every=args.check_every,
                        trace=args.trace)

    async def route() -> int:
        return await Router(source, settings).run()

    return asyncio.run(route())


if __name__ == "__main__":
    sys.exit(main())
