"""pymultiworld's `WorldCommunicator` and `BrokenWorldException`, where its programs import them.

Each op awaits the named world's own op (world/core.py, world/ops.py): nothing polls, and a broken world
raises BrokenWorldException from pending and new ops. World names are pymultiworld's (any
string, "" by default); see compat.py for how they map to the library's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from multiworld.errors import UnknownWorldError, WorldBrokenError
from multiworld.pymultiworld.world_labels import DEFAULT_WORLD_NAME, world_label
from multiworld.world.reduce_op import ReduceOp

if TYPE_CHECKING:
    from torch import Tensor

    from multiworld.world.core import World
    from multiworld.world.ops import AnyReduceOp


class BrokenWorldException(WorldBrokenError):
    """An op on a broken world (pymultiworld's error). A WorldBrokenError too, so code written
    for either API catches it; `world` is the pymultiworld name."""

    def __init__(self, world_name: str, msg: str, epoch: int = 0, peer_rank: int | None = None) -> None:
        super().__init__(world_name, epoch, msg, peer_rank)
        # pymultiworld's argument order, so that copies and pickles rebuild the same error.
        self.args = (world_name, msg, epoch, peer_rank)

    def __str__(self) -> str:
        return f"{self.world} broken: {self.reason}"

    def fresh(self) -> BrokenWorldException:
        return BrokenWorldException(*self.args)


class Worlds(Protocol):
    """What a WorldCommunicator asks of its WorldManager."""

    def worlds(self) -> dict[str, World]: ...
    def world(self, name: str) -> World: ...


class Initialized:
    """Every pymultiworld world name initialized through one WorldManager, with its latest epoch
    (kept after remove_world): compat.py records them; an op on a removed world names it."""

    def __init__(self) -> None:
        self._epochs: dict[str, int] = {}

    def __contains__(self, world_name: str) -> bool:
        return world_name in self._epochs

    def epoch(self, world_name: str) -> int:
        """The latest epoch of `world_name` initialized here (0: never)."""
        return self._epochs.get(world_name, 0)

    def record(self, world_name: str, epoch: int) -> None:
        self._epochs[world_name] = epoch


class WorldCommunicator:
    """The ops of every world of one WorldManager, by world name (`world_manager.communicator`)."""

    def __init__(self, world_manager: Worlds) -> None:
        self._manager = world_manager
        self.initialized = Initialized()

    def is_broken(self, world_name: str = DEFAULT_WORLD_NAME) -> bool:
        """True unless the world is held here and healthy."""
        world = self._manager.worlds().get(world_label(world_name))
        return world is None or world.broken

    def _world(self, world_name: str) -> World:
        try:
            return self._manager.world(world_label(world_name))
        except UnknownWorldError:
            if world_name in self.initialized:
                raise BrokenWorldException(
                    world_name, "removed from this process (remove_world)", self.initialized.epoch(world_name)
                ) from None
            raise UnknownWorldError(world_name, "initialize_world it first") from None

    async def _run(self, world_name: str, op: str, *args: Any) -> None:
        world = self._world(world_name)
        try:
            await getattr(world, op)(*args, async_op=True)
        except WorldBrokenError as exc:
            raise BrokenWorldException(world_name, exc.reason, exc.epoch, exc.peer_rank) from exc

    async def send(self, tensor: Tensor, dst: int, world_name: str = DEFAULT_WORLD_NAME) -> None:
        await self._run(world_name, "send", tensor, dst)

    async def recv(self, tensor: Tensor, src: int, world_name: str = DEFAULT_WORLD_NAME) -> None:
        await self._run(world_name, "recv", tensor, src)

    async def broadcast(self, tensor: Tensor, src: int, world_name: str = DEFAULT_WORLD_NAME) -> None:
        await self._run(world_name, "broadcast", tensor, src)

    async def all_reduce(
        self, tensor: Tensor, op: AnyReduceOp = ReduceOp.SUM, world_name: str = DEFAULT_WORLD_NAME
    ) -> None:
        await self._run(world_name, "all_reduce", tensor, op)

    async def reduce(
        self, tensor: Tensor, dst: int, op: AnyReduceOp = ReduceOp.SUM, world_name: str = DEFAULT_WORLD_NAME
    ) -> None:
        await self._run(world_name, "reduce", tensor, dst, op)

    async def all_gather(self, tensors: Sequence[Tensor], tensor: Tensor, world_name: str = DEFAULT_WORLD_NAME) -> None:
        await self._run(world_name, "all_gather", tensors, tensor)

    async def gather(
        self,
        tensor: Tensor,
        gather_list: Sequence[Tensor] | None = None,
        dst: int = 0,
        world_name: str = DEFAULT_WORLD_NAME,
    ) -> None:
        await self._run(world_name, "gather", tensor, gather_list, dst)

    async def scatter(
        self,
        tensor: Tensor,
        scatter_list: Sequence[Tensor] | None = None,
        src: int = 0,
        world_name: str = DEFAULT_WORLD_NAME,
    ) -> None:
        await self._run(world_name, "scatter", tensor, scatter_list, src)
