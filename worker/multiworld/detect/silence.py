"""How a judge measures a peer's silence without taking its own pause for it (no torch).

A judge (the detector's thread, a link's, a build watch) reads a peer's counter every tick
and calls the peer dead once the counter has stood still for `dead_after`. On a machine whose
cores are saturated the judge itself runs late: its thread waits for a core or for the GIL,
or its whole process is descheduled, and its store's server with it, so the peer's beats
queue up unanswered. Measured in wall time, such a pause would count as the peer's silence.
Three rules keep it out:

1. The judge's own clock (`JudgeClock`): wall time, except that a gap between two of the
   judge's readings counts at most `LATE_TICKS` intervals. A judge that was paused for a
   second credits the peer's silence with two intervals of it, not the second, and so judges
   only after enough ticks of its own have run, each of which gave the peer a chance to beat.
   A judge that is slowed rather than paused still judges, later in wall time (detection
   slows down with the machine instead of turning false).
2. Conservative readings (`StillCounter.see`): the silence runs from the moment the reading
   that first saw the counter's current value *returned* to the moment the reading that
   still sees it was *sent*; a stall inside either call never counts.
3. A confirmation read: a reading that would give a verdict is repeated at once, and the
   verdict stands only if the repeat still finds the counter still: a judge's read that the
   store answered before the peer's queued beat (its process just woke up) is not the last
   word. A call found stuck is confirmed after a short yield to the thread that made it.

What this cannot see: a peer whose own beating thread is starved for `dead_after` (its cores,
the GIL held by its own code, a garbage collection) is silent, and judged so; `dead_after`
is the margin for that (bench/failover.py --load measures the longest silence of healthy
peers on saturated cores).
"""

from __future__ import annotations

import time

# A gap between two of a judge's readings counts at most this many intervals: one interval
# late is still on time; more is the judge's own pause, which is not the peer's silence.
LATE_TICKS = 2.0
# A judge that finds a call stuck past dead_after yields this long to the thread that made
# it, which may have its answer already, before it believes the call is stuck.
CONFIRM_YIELD_S = 0.01


class JudgeClock:
    """A judge's own time in seconds (from an arbitrary start): each reading adds the wall time
    since the previous one, at most LATE_TICKS x `interval`. Read by its judge's thread only."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._wall = time.monotonic()
        self._now = 0.0
        self._late = 0  # readings whose gap was cut since take_late

    def now(self) -> float:
        wall = time.monotonic()
        gap, cap = wall - self._wall, LATE_TICKS * self.interval
        if gap > cap:
            gap = cap
            self._late += 1
        self._wall = wall
        self._now += max(gap, 0.0)
        return self._now

    def take_late(self) -> int:
        """How many readings came more than LATE_TICKS intervals after the previous one since
        the last call: how often this judge ran late."""
        late, self._late = self._late, 0
        return late

    def since_wall(self, wall: float) -> float:
        """This clock's reading at the wall time `wall` (monotonic, not after the last
        reading): the last reading less the wall time since, at most LATE_TICKS intervals."""
        return self._now - min(max(self._wall - wall, 0.0), LATE_TICKS * self.interval)


class StillCounter:
    """A peer's counter as one judge sees it: its last value, and since when (judge's clock)."""

    __slots__ = ("value", "changed")

    def __init__(self, now: float) -> None:
        self.value: bytes | None = None
        self.changed = now

    def see(self, value: bytes, sent: float, returned: float) -> float:
        """Record a reading sent and returned at these times of the judge's clock; how long
        the counter has stood still: from the return of the reading that first saw its value
        to the sending of this one (0.0 when it moved)."""
        if value != self.value:
            self.value = value
            self.changed = returned
            return 0.0
        return max(sent - self.changed, 0.0)
