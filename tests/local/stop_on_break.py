"""A member program in pymultiworld's style: it runs all-reduce steps in every world of its
MultiWorld environment and, when a world breaks, prints so and stops with status 0 (it does not
wait for the world's next epoch). The platform replaces its pod; the new one starts again."""

from __future__ import annotations

import asyncio
import sys

import torch

import multiworld as mw


async def steps(world: mw.World) -> None:
    step = 0
    while True:
        step += 1
        tensor = torch.ones(4)
        work = world.all_reduce(tensor, async_op=True)
        assert work is not None  # async_op=True returns the op's Work
        await work
        print(f"{world.name} epoch {world.epoch} step {step}", flush=True)
        await asyncio.sleep(0.1)


async def main() -> int:
    manager = mw.init_from_env()
    try:
        await asyncio.gather(*(steps(world) for world in manager.worlds().values()))
    except mw.WorldBrokenError as exc:
        print(f"{exc.world} broke: {exc.reason}; stopping", flush=True)
    finally:
        manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
