"""All-reduce (sum) in every world of this process: each rank ends up with the world's sum."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared module

import common  # noqa: E402
from multiworld import World  # noqa: E402


async def all_reduce(world: World, step: int) -> None:
    tensor = common.own_tensor(world, step)
    common.say(f"rank: {world.rank} has tensor: {tensor}")
    await world.all_reduce(tensor, async_op=True)
    common.say(f"rank: {world.rank} from {world.name} has reduced tensor: {tensor}")


if __name__ == "__main__":
    common.main(all_reduce, __doc__)
