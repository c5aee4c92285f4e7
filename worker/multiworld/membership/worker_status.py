"""What a worker tells the platform through its channel: its status, sent again at each change,
and a report for each world that broke or could not be joined. No torch."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from multiworld import metrics
from multiworld.channels import Channel
from multiworld.contract import JOIN_FAILED, BrokenWorldReport, WorkerStatus, WorldAssignment
from multiworld.membership.holdings import Holdings

if TYPE_CHECKING:
    from multiworld.errors import WorldBrokenError
    from multiworld.world.core import World


class StatusReporter:
    """The status and failure reports of one WorldManager's worlds."""

    def __init__(self, held: Holdings, channel: Channel, pod: str) -> None:
        self._held = held
        self._channel = channel
        self._pod = pod
        self._started = datetime.now(UTC)
        self._errors: dict[str, int] = {}  # failures seen per world
        self._last: WorkerStatus | None = None

    def status(self) -> WorkerStatus:
        """What this process holds now: healthy worlds' epochs, and failures seen per world."""
        held = self._held
        with held.lock:
            joined = {name: w.epoch for name, w in held.worlds().items() if not w.broken}
            return WorkerStatus(
                pod=self._pod,
                joined=joined,
                joining={name: j.assignment.epoch for name, j in held.joins().items()},
                errors=dict(self._errors),
                started=self._started,
                joined_at={name: held.joined_at(name) for name in joined},
                waiting=held.waiting,
                plays=held.plays,
            )

    def changed(self) -> None:
        """Something held changed: send the status if it differs from the last one sent, and
        wake the watchers (see Holdings.watch)."""
        with self._held.lock:
            status = self.status()
            if status != self._last:
                self._last = status
                self._channel.status(status)  # queued, so order is kept under the lock
            watchers = self._held.take_watchers()
        for wake in watchers:
            try:
                wake()
            except RuntimeError:  # an event loop that is gone
                pass

    def world_broken(self, world: World, error: WorldBrokenError, report: bool) -> None:
        """A held world broke (its on_broken callback); `report` is False when this process
        chose to drop it."""
        if report:
            with self._held.lock:
                self._errors[world.name] = self._errors.get(world.name, 0) + 1
            metrics.world_broke(world.name)
            self._channel.report(
                BrokenWorldReport(
                    world=error.world,
                    epoch=error.epoch,
                    reason=error.reason,
                    peer_rank=error.peer_rank,
                    pod=self._pod,
                    plays=self._held.plays,
                )
            )
        self.changed()

    def join_failed(self, a: WorldAssignment, exc: BaseException) -> None:
        """A join failed (neither called off nor stale): the platform decides from this report
        whether the epoch failed."""
        self._channel.report(
            BrokenWorldReport(
                world=a.name, epoch=a.epoch, reason=f"{JOIN_FAILED}{exc}", pod=self._pod, plays=self._held.plays
            )
        )
