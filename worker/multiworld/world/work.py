"""Ops in flight: the awaitable `Work`, what it may ask of its world (`InFlight`), and the
waiter threads for works without a future.

No torch import: a `Work` only calls methods of the torch objects it is given.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Generator
from typing import Any

from multiworld import metrics
from multiworld.errors import WorldBrokenError
from multiworld.shutdown import start_thread

log = logging.getLogger(__name__)


def _resolve(fut: asyncio.Future[None], error: WorldBrokenError | None) -> None:
    if fut.done():  # cancelled, or resolved by the awaiter itself (see Work.__await__)
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error.fresh())


class InFlight:
    """One world's async ops that have not settled yet, and all that their Works may ask of
    that world: its name and epoch (their repr), the lock they settle under, and `op_failed`,
    which breaks the world when an op fails as it runs and returns the error to fail with,
    and `recorder`, its op metrics (None unless this process serves metrics). The world owns
    one (see ops.Collectives); each Work it starts holds it."""

    __slots__ = ("world", "epoch", "lock", "op_failed", "works", "recorder")

    def __init__(
        self,
        world: str,
        epoch: int,
        lock: threading.Lock,
        op_failed: Callable[[str, BaseException], WorldBrokenError],
    ) -> None:
        self.world = world
        self.epoch = epoch
        self.lock = lock
        self.op_failed = op_failed
        self.works: set[Work] = set()
        self.recorder = metrics.recorder(world)

    def take(self) -> set[Work]:
        """Stop tracking every work (the world broke; its lock is held): the caller fails them.
        An op that read `works` before this may still add to the old set (it then sees the
        world broken and fails its work itself)."""
        works, self.works = self.works, set()
        return works


class Work:
    """An op started with `async_op=True`: `await work`, `work.wait(timeout)`, `work.is_completed()`.

    It completes when the op does, or fails with `WorldBrokenError` as soon as its world
    breaks, whichever comes first. `settle`, `on_future` and `wait_here` are the library's:
    the world and its backend driver settle a work through them (see backends.Tracked).
    `started`: what the world's recorder gave when the op was issued (see InFlight).
    """

    __slots__ = ("op", "_in_flight", "_torch_work", "_started", "_done", "_event", "_error", "_listeners")

    def __init__(self, in_flight: InFlight, op: str, torch_work: Any, started: float) -> None:
        self.op = op
        self._in_flight = in_flight
        self._torch_work = torch_work
        self._started = started
        self._done = False
        # Made only when a thread waits: most works are awaited, and building and setting an
        # Event for each showed in an awaited op's time (bench/collectives.py, all_reduce_async).
        self._event: threading.Event | None = None
        self._error: WorldBrokenError | None = None
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self._done else "pending"
        return f"<Work {self.op} on {self._in_flight.world!r} epoch {self._in_flight.epoch}: {state}>"

    def is_completed(self) -> bool:
        """True once the op finished or failed."""
        return self._done

    def exception(self) -> WorldBrokenError | None:
        """The WorldBrokenError the op failed with; None while pending or once it succeeded."""
        return self._error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; True on success, WorldBrokenError if the world broke, TimeoutError
        if `timeout` seconds pass first (the op goes on)."""
        if not self._done:
            with self._in_flight.lock:
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(timeout):
                raise TimeoutError(f"{self.op} on world {self._in_flight.world!r} not complete after {timeout}s")
        if self._error is not None:
            raise self._error.fresh()
        return True

    def __await__(self) -> Generator[Any, None, None]:
        # The awaiter waits on an asyncio future directly (no generator of our own in between)
        # and registers it without a lock: settle marks the work done before it reads the
        # listeners, so a settle this registration raced with is seen by the second check.
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if not self._done:
            self._listeners.append((loop, fut))
            if not self._done:
                return fut.__await__()
        _resolve(fut, self._error)
        return fut.__await__()

    def settle(self, error: WorldBrokenError | None) -> None:
        """Complete (error None) or fail; from any thread, the first call wins."""
        in_flight = self._in_flight
        with in_flight.lock:
            if self._done:
                return
            # Before the work is done: whoever sees it done sees its duration recorded.
            if error is None and in_flight.recorder is not None:
                in_flight.recorder.done(self.op, self._started)
            self._error = error
            self._done = True
            event = self._event
        in_flight.works.discard(self)
        if event is not None:
            event.set()
        for loop, fut in self._listeners:
            try:
                loop.call_soon_threadsafe(_resolve, fut, error)
            except RuntimeError:  # that event loop is closed; nobody awaits any more
                pass

    def on_future(self, fut: Any) -> None:
        """torch Future done-callback (runs on a communicator thread): settle."""
        try:
            fut.value()
        except Exception as exc:
            self.settle(self._in_flight.op_failed(self.op, exc))
            return
        self.settle(None)

    def wait_here(self) -> None:
        """Wait for the torch work in the calling thread, then settle; its failure breaks the
        world and raises (NCCL: the caller's current stream waits for the op's)."""
        try:
            self._torch_work.wait()
        except RuntimeError as exc:
            raise self._in_flight.op_failed(self.op, exc).fresh() from exc
        self.settle(None)

    def _wait_torch_work(self) -> None:
        """Block on the torch work itself (a waiter thread), then settle."""
        try:
            self._torch_work.wait()
        except Exception as exc:
            self.settle(self._in_flight.op_failed(self.op, exc))
            return
        self.settle(None)


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
