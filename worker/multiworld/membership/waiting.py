"""Waiting until what a WorldManager holds changes: a world held healthy at a newer epoch, a join
done, a spare's identity. An event loop awaits, a thread blocks; both are woken at each change
(see Holdings.watch and StatusReporter.changed), never by polling. No torch.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from multiworld.membership.holdings import Holdings

if TYPE_CHECKING:
    from multiworld.world.core import World


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Waits:
    """Waits on one manager's holdings. Each `predicate` runs under the holdings' lock, once
    now and again after each change; a closed manager ends every wait with RuntimeError."""

    def __init__(self, held: Holdings) -> None:
        self._held = held

    async def until(self, predicate: Callable[[], bool], timeout: float | None, what: str) -> None:
        """Until `predicate()` holds; TimeoutError naming `what` after `timeout` seconds."""
        held = self._held
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            fut: asyncio.Future[None] = loop.create_future()
            with held.lock:
                if predicate():
                    return
                held.check_open()
                held.watch(functools.partial(loop.call_soon_threadsafe, _wake, fut))
            remaining = None if deadline is None else deadline - loop.time()
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                raise TimeoutError(f"{what} not ready after {timeout}s") from None

    def until_blocking(self, predicate: Callable[[], bool], timeout: float | None, what: str) -> None:
        """`until` for a thread without an event loop. An Event's wait is interruptible on POSIX,
        so SIGINT and SIGTERM handlers still run while the main thread blocks here."""
        held = self._held
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            woken = threading.Event()
            with held.lock:
                if predicate():
                    return
                held.check_open()
                held.watch(woken.set)
            remaining = None if deadline is None else deadline - time.monotonic()
            if (remaining is not None and remaining <= 0) or not woken.wait(remaining):
                raise TimeoutError(f"{what} not ready after {timeout}s")

    async def world(self, name: str, newer_than: int | None, timeout: float | None) -> World:
        """Until the world is held healthy at an epoch above `newer_than` (None: any epoch)."""
        found = _Ready(self._held, name, newer_than)
        await self.until(found, timeout, _describe(name, newer_than))
        return found.world

    def world_blocking(self, name: str, newer_than: int | None, timeout: float | None) -> World:
        found = _Ready(self._held, name, newer_than)
        self.until_blocking(found, timeout, _describe(name, newer_than))
        return found.world


class _Ready:
    """The predicate of a wait for a world: true once it is held healthy at an epoch above
    `newer_than`; then `world` is that world."""

    def __init__(self, held: Holdings, name: str, newer_than: int | None) -> None:
        self._held = held
        self._name = name
        self._newer_than = newer_than or 0
        self.world: World

    def __call__(self) -> bool:
        world = self._held.world(self._name)
        if world is not None and not world.broken and world.epoch > self._newer_than:
            self.world = world
            return True
        return False


def _describe(name: str, newer_than: int | None) -> str:
    return f"world {name!r} (epoch > {newer_than or 0})"
