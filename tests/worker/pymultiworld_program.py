"""A program written the way pymultiworld's examples are: asyncio, `--worldinfo W,R` (world
index W, rank R; world size 3), one task per world that steps until done or until its op
raises, then `world_manager.cleanup()`. Only pymultiworld's API is used.

`--op all` runs every op each step; `--op all_reduce` one all_reduce of ones. `--reinit N`:
initialize a broken world again, up to N times. Tensors are `mine(W, R, step)`. Each line on
stdout is a JSON event (member.emit).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import torch.distributed as dist

from multiworld.communicator import BrokenWorldException, WorldCommunicator
from multiworld.manager import WorldManager
from tests.worker.member import emit, use_backend, values

WORLD_SIZE = 3
LENGTH = 3

world_manager: WorldManager | None = None


def mine(index: int, rank: int, step: int) -> torch.Tensor:
    """Rank `rank`'s tensor of world `index` at `step`."""
    return torch.arange(LENGTH, dtype=torch.float32) + (100 * index + 10 * rank + step)


def where(world_name: str) -> tuple[str, ...]:
    """The world_name argument: left out for the default world "" (pymultiworld's default)."""
    return (world_name,) if world_name else ()


async def every_op(comm: WorldCommunicator, world_name: str, index: int, rank: int, step: int) -> dict[str, Any]:
    w, n, out = where(world_name), WORLD_SIZE, {}

    t = mine(index, rank, step)
    await comm.all_reduce(t, dist.ReduceOp.SUM, *w)
    out["all_reduce"] = values(t)

    t = mine(index, rank, step)
    await comm.all_reduce(t, dist.ReduceOp.MAX, *w)
    out["all_reduce_max"] = values(t)

    t = mine(index, rank, step)
    await comm.reduce(t, 0, dist.ReduceOp.SUM, *w)
    if rank == 0:
        out["reduce"] = values(t)

    t = mine(index, rank, step)
    await comm.broadcast(t, 0, *w)
    out["broadcast"] = values(t)

    t = mine(index, rank, step)
    await comm.broadcast(t, n - 1, *w)
    out["broadcast_last"] = values(t)

    tensors = [torch.zeros(LENGTH) for _ in range(n)]
    await comm.all_gather(tensors, mine(index, rank, step), *w)
    out["all_gather"] = values(tensors)

    gathered = [torch.zeros(LENGTH) for _ in range(n)] if rank == 0 else None
    await comm.gather(mine(index, rank, step), gathered, 0, *w)
    if gathered is not None:
        out["gather"] = values(gathered)

    t = torch.zeros(LENGTH)
    pieces = [mine(index, peer, step) for peer in range(n)] if rank == 0 else None
    await comm.scatter(t, pieces, 0, *w)
    out["scatter"] = values(t)

    # As send_recv's leader: rank 0 receives from every other rank in turn, then answers each.
    if rank == 0:
        received = []
        for peer in range(1, n):
            t = torch.zeros(LENGTH)
            await comm.recv(t, peer, *w)
            received += values(t)
        out["recv"] = received
        for peer in range(1, n):
            await comm.send(mine(index, 0, step) + peer, peer, *w)
    else:
        await comm.send(mine(index, rank, step), 0, *w)
        t = torch.zeros(LENGTH)
        await comm.recv(t, 0, *w)
        out["recv"] = values(t)
    return out


async def all_reduce(comm: WorldCommunicator, world_name: str, index: int, rank: int, step: int) -> dict[str, Any]:
    t = torch.ones(LENGTH)
    await comm.all_reduce(t, dist.ReduceOp.SUM, *where(world_name))
    return {"all_reduce": values(t)}


STEPS: dict[str, Callable[[WorldCommunicator, str, int, int, int], Awaitable[dict[str, Any]]]] = {
    "all": every_op,
    "all_reduce": all_reduce,
}


async def init_world(world_name: str, rank: int, port: int, args: argparse.Namespace) -> None:
    assert world_manager is not None
    device = torch.device("cuda" if args.backend == "nccl" else "cpu")
    await world_manager.initialize_world(
        world_name,
        rank,
        WORLD_SIZE,
        backend=args.backend,
        addr=args.addr,
        port=port,
        timeout=args.timeout,
        device=device,
    )


async def run_world(world_name: str, index: int, rank: int, port: int, args: argparse.Namespace) -> None:
    assert world_manager is not None
    communicator = world_manager.communicator
    step, reinits = 1, 0
    while step <= args.steps:
        try:
            results = await STEPS[args.op](communicator, world_name, index, rank, step)
        except Exception as e:
            print(f"caught an exception: {e}")
            emit(
                "caught",
                world=index,
                step=step,
                error=str(e),
                broken=isinstance(e, BrokenWorldException),
                is_broken=communicator.is_broken(world_name),
            )
            if reinits >= args.reinit:
                break
            reinits += 1
            try:
                await init_world(world_name, rank, port, args)
            except Exception as e:
                print(f"caught an exception: {e}")
                emit("reinit_failed", world=index, error=str(e), type=type(e).__name__)
                break
            emit("reinitialized", world=index, is_broken=communicator.is_broken(world_name))
            continue
        emit("step", world=index, step=step, results=results)
        await asyncio.sleep(args.interval)
        step += 1
    emit("done", world=index, steps=step - 1)


async def main(args: argparse.Namespace) -> None:
    global world_manager
    world_manager = WorldManager(enable_monitor=not args.no_monitor)
    names = {int(w): name for w, name in (item.split(",", 1) for item in args.name or [])}
    ports = {int(w): int(p) for w, p in (item.split(",") for item in args.port or [])}

    worlds = []
    for item in args.worldinfo:
        index, rank = (int(x) for x in item.split(","))
        world_name = names.get(index, f"world{index}")
        port = ports.get(index, 29500 + 1000 * index)
        await init_world(world_name, rank, port, args)
        worlds.append((world_name, index, rank, port))
    emit("initialized", worlds=[index for _, index, _, _ in worlds])

    tasks = [asyncio.create_task(run_world(*world, args)) for world in worlds]
    await asyncio.gather(*tasks)

    emit("cleanup")
    world_manager.cleanup()
    emit("after_cleanup")  # never printed: cleanup() ends the process


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--addr", default="127.0.0.1")
    parser.add_argument("--worldinfo", type=str, action="append", required=True)
    parser.add_argument("--port", action="append", help="W,PORT: world W's store port (default 29500 + 1000*W)")
    parser.add_argument("--name", action="append", help="W,NAME: world W's name (default world<W>)")
    parser.add_argument("--op", choices=sorted(STEPS), default="all")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=30)
    parser.add_argument("--reinit", type=int, default=0)
    parser.add_argument("--no-monitor", action="store_true")
    arguments = parser.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    use_backend(arguments.backend)
    loop = asyncio.get_event_loop()
    loop.run_until_complete(main(arguments))
