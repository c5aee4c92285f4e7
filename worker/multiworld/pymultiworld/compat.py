"""pymultiworld's API (v0.2.3) on WorldManager, so that programs written for it run unchanged.

A thin face: `initialize_world` joins through the manager's own `join_async`, the
communicator's ops are the worlds' own ops, `remove_world` is `leave`. What it translates:

- world names: pymultiworld takes any string ("" by default); here a world's name is a DNS
  label (it prefixes store keys and is the contract's), so names are mapped
  (`world_labels.world_label`).
- epochs: no controller numbers a world's incarnations here; `initialize_world` reads from the
  world's store which epoch to join (`rendezvous.next_epoch`), so the survivors of a broken
  world and a restarted peer meet at the next epoch, and a replaced member is refused.
- secrets: no controller hands a world's members a secret here (the user gives the address and
  port), so a world's store keys are open to any process that reaches rank 0's store port: the
  contract that a process holding no rank in a world can neither read nor write its rendezvous
  state holds for worlds a controller manages (`multiworld run`, the operator), not these.
  Keep such a store where only the world's members reach it.
- `cleanup()`: ends the process, as pymultiworld documents.

No torch at import (the manager imports this module).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from multiworld import shutdown
from multiworld.contract import Backend, WorldAssignment
from multiworld.errors import StaleEpochError, UnknownWorldError, WorldJoinError, short
from multiworld.pymultiworld.world_labels import world_label

if TYPE_CHECKING:
    import torch

    from multiworld.communicator import WorldCommunicator
    from multiworld.detect.config import DetectConfig
    from multiworld.world.core import World

T = TypeVar("T")


class WorldRequest(BaseModel):
    """`initialize_world`'s arguments, by pymultiworld's names (so errors name them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    world_name: StrictStr
    rank: StrictInt = Field(ge=0)
    world_size: StrictInt = Field(ge=2)
    backend: Backend
    addr: StrictStr = Field(min_length=1)
    # pymultiworld's default (-1) names no port: the port must be given.
    port: StrictInt = Field(ge=1, le=65535)
    timeout: float = Field(gt=0)

    @model_validator(mode="after")
    def _rank_in_world(self) -> WorldRequest:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is out of range for world_size {self.world_size}")
        return self

    def assignment(self, epoch: int) -> WorldAssignment:
        return WorldAssignment(
            name=world_label(self.world_name),
            rank=self.rank,
            size=self.world_size,
            host=self.addr,
            port=self.port,
            epoch=epoch,
            backend=self.backend,
        )


class Manager(Protocol):
    """What the face asks of the WorldManager it is mixed into (each method's `self`)."""

    config: DetectConfig

    @property
    def communicator(self) -> WorldCommunicator: ...
    def worlds(self) -> dict[str, World]: ...
    def world(self, name: str) -> World: ...
    async def join_async(
        self,
        assignment: WorldAssignment | Mapping[str, Any],
        *,
        config: DetectConfig | None = None,
        device: str | torch.device | None = None,
    ) -> World: ...
    def leave(self, name: str) -> None: ...
    def unserve_if_unused(self, a: WorldAssignment) -> None: ...


class PymultiworldFace:
    """pymultiworld's WorldManager methods, mixed into WorldManager (see `Manager`). Its one
    piece of state, the communicator, is made here on first use."""

    @cached_property
    def communicator(self: Manager) -> WorldCommunicator:
        """The process's one WorldCommunicator (pymultiworld's ops)."""
        from multiworld.communicator import WorldCommunicator

        return WorldCommunicator(self)

    async def initialize_world(
        self: Manager,
        world_name: str,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        addr: str = "127.0.0.1",
        port: int = -1,
        timeout: float = 30,
        device: str | torch.device | None = None,
    ) -> None:
        """Join world `world_name` as `rank` of `world_size`; rank 0 serves its store at
        `port`, the others find it at `addr`. `timeout`: seconds to wait for every member.
        `device`: nccl's GPU (default: cuda:$LOCAL_RANK, else the current one).

        A name whose world broke (or was removed) can be initialized again: it is joined at
        the world's next epoch, with the other members that initialize it again.
        """
        request = WorldRequest(
            world_name=world_name,
            rank=rank,
            world_size=world_size,
            backend=backend,
            addr=addr,
            port=port,
            timeout=timeout,
        )
        label = world_label(world_name)
        held = self.worlds().get(label)
        if held is not None and not held.broken:
            raise ValueError(
                f"world_name {world_name!r} is initialized already (epoch {held.epoch}) and healthy; "
                "remove_world it first"
            )
        communicator = self.communicator
        held_epoch = max(communicator.initialized.epoch(world_name), held.epoch if held is not None else 0)
        deadline = time.monotonic() + request.timeout
        while True:
            try:
                epoch = await _in_thread(_read_next_epoch, f"mw-epoch-{label}", request, held_epoch, deadline)
            except BaseException:
                self.unserve_if_unused(request.assignment(held_epoch + 1))
                raise
            left = max(deadline - time.monotonic(), 0.001)
            config = self.config.model_copy(update={"join_timeout": left})
            try:
                world = await self.join_async(request.assignment(epoch), config=config, device=device)
            except StaleEpochError:
                if time.monotonic() >= deadline:
                    raise
                continue  # the world moved on while this process joined it: join the newer epoch
            communicator.initialized.record(world_name, world.epoch)
            return

    def remove_world(self: Manager, world_name: str) -> None:
        """Leave the world: its peers see it broken. Its name can be initialized again."""
        try:
            self.leave(world_label(world_name))
        except UnknownWorldError:
            if world_name not in self.communicator.initialized:
                raise UnknownWorldError(world_name, "remove_world: it was never initialized here") from None

    def cleanup(self) -> NoReturn:
        """End the process now, with exit status 0, as pymultiworld's cleanup does (nothing
        after it runs). Every world is left first, so the peers read a deliberate leave, not a
        failure; the wait for that is bounded."""
        shutdown.end_process(0)


def _read_next_epoch(request: WorldRequest, held: int, deadline: float) -> int:
    """The epoch to join, from the world's store (blocking: a library thread runs it)."""
    from multiworld.world import rendezvous, stores

    label = world_label(request.world_name)
    store = stores.open_client(
        label,
        request.rank,
        request.addr,
        request.port,
        deadline=deadline,
        cancelled=threading.Event(),
        wait_timeout=request.timeout,
    )
    try:
        return rendezvous.next_epoch(store, label, request.rank, held)
    except WorldJoinError:
        raise
    except Exception as exc:  # the store went away under us
        raise WorldJoinError(
            f"world {request.world_name!r}: reading its epoch from its store failed: {short(exc)}"
        ) from exc


async def _in_thread(fn: Callable[..., T], name: str, *args: Any) -> T:
    """Await `fn(*args)` run on a library thread (it calls into torch: see shutdown.py)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the event loop is closed: nobody awaits any more
            pass

    shutdown.start_thread(run, name)
    return await fut
