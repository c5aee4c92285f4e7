"""Ops in flight: the awaitable `Work`, and the waiter threads for works without a future.

No torch import: a `Work` only calls methods of the torch objects it is given.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from multiworld.errors import WorldBrokenError
from multiworld.shutdown import start_thread

if TYPE_CHECKING:
    from multiworld.world import World

log = logging.getLogger(__name__)


def _resolve(fut: asyncio.Future[None], error: WorldBrokenError | None) -> None:
    if fut.done():  # cancelled, or resolved by the awaiter itself (see Work.__await__)
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error.fresh())


class Work:
    """An op started with `async_op=True`: `await work`, `work.wait(timeout)`, `work.is_completed()`.

    It completes when the op does, or fails with `WorldBrokenError` as soon as its world
    breaks, whichever comes first.
    """

    __slots__ = ("op", "_world", "_torch_work", "_done", "_event", "_error", "_listeners")

    def __init__(self, world: World, op: str, torch_work: Any) -> None:
        self.op = op
        self._world = world
        self._torch_work = torch_work
        self._done = False
        # Made only when a thread waits: most works are awaited, and building and setting an
        # Event for each showed in an awaited op's time (bench/collectives.py, all_reduce_async).
        self._event: threading.Event | None = None
        self._error: WorldBrokenError | None = None
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self._done else "pending"
        return f"<Work {self.op} on {self._world.name!r} epoch {self._world.epoch}: {state}>"

    def is_completed(self) -> bool:
        """True once the op finished or failed."""
        return self._done

    def exception(self) -> WorldBrokenError | None:
        return self._error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; True on success, WorldBrokenError if the world broke, TimeoutError
        if `timeout` seconds pass first (the op goes on)."""
        if not self._done:
            with self._world._lock:
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(timeout):
                raise TimeoutError(f"{self.op} on world {self._world.name!r} not complete after {timeout}s")
        if self._error is not None:
            raise self._error.fresh()
        return True

    def __await__(self) -> Generator[Any, None, None]:
        # The awaiter waits on an asyncio future directly (no generator of our own in between)
        # and registers it without a lock: _settle marks the work done before it reads the
        # listeners, so a settle this registration raced with is seen by the second check.
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if not self._done:
            self._listeners.append((loop, fut))
            if not self._done:
                return fut.__await__()
        _resolve(fut, self._error)
        return fut.__await__()

    def _settle(self, error: WorldBrokenError | None) -> None:
        """Complete (error None) or fail; from any thread, the first call wins."""
        world = self._world
        with world._lock:
            if self._done:
                return
            self._error = error
            self._done = True
            event = self._event
        world._pending.discard(self)
        if event is not None:
            event.set()
        for loop, fut in self._listeners:
            try:
                loop.call_soon_threadsafe(_resolve, fut, error)
            except RuntimeError:  # that event loop is closed; nobody awaits any more
                pass

    def _on_future(self, fut: Any) -> None:
        """torch Future done-callback (runs on a communicator thread)."""
        try:
            fut.value()
        except Exception as exc:
            self._settle(self._world._op_failed(self.op, exc))
            return
        self._settle(None)

    def _wait_torch_work(self) -> None:
        """Block on the torch work itself (a waiter thread), then settle."""
        try:
            self._torch_work.wait()
        except Exception as exc:
            self._settle(self._world._op_failed(self.op, exc))
            return
        self._settle(None)


class Waiters:
    """Daemon threads that call `wait()` on works that offer no future (gloo's async send and
    recv, and its reduce_scatter; a blocking send or recv is waited for by its caller).

    A thread is reused when idle and a new one starts only when all are busy, so unrelated
    ops never wait on each other. A wait stuck on a silent peer never holds up process exit
    (see shutdown.py).
    """

    def __init__(self, world: str) -> None:
        self._world = world
        self._queue: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0
        self._stopped = False

    def submit(self, work: Work) -> None:
        with self._lock:
            if self._stopped:
                return  # the world broke after the op started, and that failed the work already
            if self._idle:
                self._idle -= 1
            else:
                self._threads += 1
                start_thread(self._serve, f"mw-wait-{self._world}-{self._threads}")
        self._queue.put(work)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            count = self._threads
        for _ in range(count):
            self._queue.put(None)

    def _serve(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            work._wait_torch_work()
            del work
            with self._lock:
                self._idle += 1
