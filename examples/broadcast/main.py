"""Broadcast in every world of this process: the leader's (rank 0) tensor reaches every rank."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared module

import common  # noqa: E402
from multiworld import World  # noqa: E402


async def broadcast(world: World, step: int) -> None:
    if world.rank == common.ROOT:
        tensor = common.own_tensor(world, step)
        common.say(f"rank: {world.rank} has tensor to be broadcast: {tensor}")
    else:
        tensor = common.empty_tensor(world)
    await world.broadcast(tensor, src=common.ROOT, async_op=True)
    if world.rank != common.ROOT:
        common.say(f"rank: {world.rank} from {world.name} receives tensor: {tensor}")


if __name__ == "__main__":
    common.main(broadcast, __doc__)
