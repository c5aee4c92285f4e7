"""Point to point in every world of this process: the leader (rank 0), a member of several
worlds, receives from every other rank of each world, every step."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared module

import common  # noqa: E402
from multiworld import World  # noqa: E402


async def send_recv(world: World, step: int) -> None:
    if world.rank == common.ROOT:
        for peer in range(world.size):
            if peer == common.ROOT:
                continue
            tensor = common.empty_tensor(world)
            await world.recv(tensor, src=peer, async_op=True)
            common.say(f"rank: {world.rank} from {world.name} received tensor: {tensor} from rank {peer}")
    else:
        tensor = common.own_tensor(world, step)
        await world.send(tensor, dst=common.ROOT, async_op=True)
        common.say(f"rank: {world.rank} from {world.name} sent tensor: {tensor}")


if __name__ == "__main__":
    common.main(send_recv, __doc__)
