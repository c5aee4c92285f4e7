"""Reduce (sum) in every world of this process: the leader (rank 0) gets the world's sum."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared module

import common  # noqa: E402
from multiworld import World  # noqa: E402


async def reduce(world: World, step: int) -> None:
    tensor = common.own_tensor(world, step)
    common.say(f"rank: {world.rank} has tensor to be reduced: {tensor}")
    await world.reduce(tensor, dst=common.ROOT, async_op=True)
    if world.rank == common.ROOT:
        common.say(f"rank: {world.rank} from {world.name} has reduced tensor: {tensor}")


if __name__ == "__main__":
    common.main(reduce, __doc__)
