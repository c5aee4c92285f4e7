"""Gather in every world of this process: the leader (rank 0) collects every rank's tensor."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared module

import common  # noqa: E402
from multiworld import World  # noqa: E402


async def gather(world: World, step: int) -> None:
    tensor = common.own_tensor(world, step)
    common.say(f"rank: {world.rank} has tensor: {tensor}")
    if world.rank == common.ROOT:
        gathered = [common.empty_tensor(world) for _ in range(world.size)]
        await world.gather(tensor, gathered, dst=common.ROOT, async_op=True)
        common.say(f"rank: {world.rank} from {world.name} has gathered tensors: {gathered}")
    else:
        await world.gather(tensor, None, dst=common.ROOT, async_op=True)


if __name__ == "__main__":
    common.main(gather, __doc__)
