"""All-gather in every world of this process: each rank ends up with every rank's tensor."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared module

import common  # noqa: E402
from multiworld import World  # noqa: E402


async def all_gather(world: World, step: int) -> None:
    tensor = common.own_tensor(world, step)
    common.say(f"rank: {world.rank} has tensor: {tensor}")
    gathered = [common.empty_tensor(world) for _ in range(world.size)]
    await world.all_gather(gathered, tensor, async_op=True)
    common.say(f"rank: {world.rank} from {world.name} has gathered tensors: {gathered}")


if __name__ == "__main__":
    common.main(all_gather, __doc__)
