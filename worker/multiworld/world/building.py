"""Building a world's communicator without waiting on a member that is gone.

A communicator's build waits for every member (gloo connects a full mesh through the world's
store), up to the op timeout, so a member that dies between the handshake and its own build
would hold the others for that long. While a member builds, it ticks a counter of its own in
the world's store (`<world>/<epoch>/building/<rank>`) and reads the others': one whose counter
stands still for `dead_after` before it has built fails the join here, naming its rank and pod.
Silence is measured as the heartbeats measure it (silence.py: on the watch's own clock, and
confirmed by a second read). A member that has built adds `BUILT` to its counter and is judged
no more.

The build runs on a thread of its own, the watch on the joining thread; a build given up goes
on in the background until it ends, and what it built then is discarded. No torch at import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from multiworld import shutdown
from multiworld.contract import WorldAssignment
from multiworld.detect.config import DetectConfig
from multiworld.detect.silence import JudgeClock, StillCounter
from multiworld.errors import JoinCancelled, WorldJoinError, short

T = TypeVar("T")

# Added to a member's counter once it has built: far above any count of ticks.
BUILT = 1 << 40


def tick_key(prefix: str, rank: int) -> str:
    return f"{prefix}building/{rank}"


class _Outcome(Generic[T]):
    """What the build thread ended with; `taken` once the watch has read it or given it up."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None
        self.given_up = False


class BuildWatch:
    """One member's watch over its world's build. `store`: a store client of its own (the
    build's waits hold their client); `pods`: each rank's pod, as the handshake gave them."""

    def __init__(
        self,
        store: Any,
        assignment: WorldAssignment,
        pods: Sequence[str],
        config: DetectConfig,
        cancelled: threading.Event,
    ) -> None:
        self._store = store
        self._a = assignment
        self._pods = list(pods)
        self._tick = config.heartbeat_interval
        self._dead_after = config.dead_after
        self._cancelled = cancelled
        self._what = f"world {assignment.name!r} epoch {assignment.epoch}"

    def run(self, build: Callable[[], T], discard: Callable[[T], None]) -> T:
        """`build()` on a thread of its own, watched; its result, or WorldJoinError naming the
        member that went silent. `discard`: what to do with a result that comes after the
        watch gave the build up."""
        outcome: _Outcome[T] = _Outcome()
        shutdown.start_thread(self._build, f"mw-build-{self._a.name}-{self._a.epoch}", build, discard, outcome)
        try:
            self._watch(outcome)
        except BaseException:
            with outcome.lock:
                outcome.given_up = True
                late = outcome.value
            if late is not None:
                discard(late)
            raise
        if outcome.error is not None:
            raise outcome.error
        assert outcome.value is not None
        try:
            self._store.add(tick_key(self._a.store_prefix, self._a.rank), BUILT)
        except Exception:
            pass  # the store is gone: the world's heartbeat tells the rest
        return outcome.value

    @staticmethod
    def _build(build: Callable[[], T], discard: Callable[[T], None], outcome: _Outcome[T]) -> None:
        try:
            value = build()
        except BaseException as exc:
            outcome.error = exc
        else:
            with outcome.lock:
                late = outcome.given_up
                outcome.value = value
            if late:
                discard(value)
        finally:
            outcome.done.set()

    def _watch(self, outcome: _Outcome[T]) -> None:
        prefix, rank = self._a.store_prefix, self._a.rank
        others = [r for r in range(self._a.size) if r != rank]
        keys = [tick_key(prefix, r) for r in others]
        store = self._store
        for key in keys:
            self._call(store.add, key, 0)  # exists from now on: a read of it never waits
        clock = JudgeClock(self._tick)
        start = clock.now()
        seen = {r: StillCounter(start) for r in others}
        mine = tick_key(prefix, rank)
        while not outcome.done.wait(self._tick):
            if self._cancelled.is_set():
                raise JoinCancelled(self._a.name)
            self._call(store.add, mine, 1)
            suspects = {r: seen[r] for r, still in self._read(clock, seen).items() if still > self._dead_after}
            if suspects:  # a confirmation read
                for r, still in self._read(clock, suspects).items():
                    if still > self._dead_after:
                        raise WorldJoinError(
                            f"{self._what}: rank {r} (pod {self._pods[r] or '?'}) went silent for "
                            f"{still:.1f}s while the world was being built"
                        )

    def _read(self, clock: JudgeClock, counters: dict[int, StillCounter]) -> dict[int, float]:
        """Read the counters of these ranks: how long each that has not built stood still."""
        prefix = self._a.store_prefix
        sent = clock.now()
        values = self._call(self._store.multi_get, [tick_key(prefix, r) for r in counters])
        returned = clock.now()
        return {
            r: counter.see(value, sent, returned)
            for (r, counter), value in zip(counters.items(), values, strict=True)
            if int(value) < BUILT
        }

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            raise WorldJoinError(
                f"{self._what}: the store of rank 0 (pod {self._pods[0] or '?'}) went away while the world "
                f"was being built: {short(exc)}"
            ) from exc
