"""Scatter in every world of this process: the leader (rank 0) hands each rank its own tensor."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared module

import common  # noqa: E402
from multiworld import World  # noqa: E402


async def scatter(world: World, step: int) -> None:
    received = common.empty_tensor(world)
    if world.rank == common.ROOT:
        device = common.world_device(world)
        parts = [common.example_tensor(world.name, rank, step, device) for rank in range(world.size)]
        common.say(f"rank: {world.rank} from {world.name} scatters tensors: {parts}")
        await world.scatter(received, parts, src=common.ROOT, async_op=True)
    else:
        await world.scatter(received, None, src=common.ROOT, async_op=True)
        common.say(f"rank: {world.rank} from {world.name} has tensor: {received}")


if __name__ == "__main__":
    common.main(scatter, __doc__)
