"""What `multiworld run` reports at the end: per world, failures, recoveries and their times."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pydantic import BaseModel, Field

from ..planner import MultiWorldStatus
from ..spec import MultiWorld

# A kill counts as the start of the failure it causes if the world fails within this long.
FAULT_ATTRIBUTION_S = 10.0


class WorldSummary(BaseModel):
    phase: str
    epoch: int
    failures: int
    recoveries: int
    recovery_seconds: list[float] = Field(default_factory=list)
    errors: int  # errors raised to member code in this world


class RunSummary(BaseModel):
    worlds: dict[str, WorldSummary]
    orphans: int

    def render(self) -> str:
        lines = ["", "summary:"]
        for name, w in self.worlds.items():
            times = ", ".join(f"{s:.2f}s" for s in w.recovery_seconds) or "-"
            lines.append(
                f"  {name}: {w.phase} at epoch {w.epoch}; failures {w.failures}, "
                f"recoveries {w.recoveries} ({times}), errors {w.errors}"
            )
        lines.append(f"  orphan processes: {self.orphans}")
        return "\n".join(lines) + "\n"


class WorldTracker:
    """Follows one world's status over time to time its recoveries: from the failure (the
    injected kill when there was one) to the world Running again with every rank joined."""

    def __init__(self) -> None:
        self.epoch = 1
        self.restarts = 0
        self.phase = "Pending"
        self.failures = 0
        self.recovery_seconds: list[float] = []
        self._fault_at: float | None = None
        self._failed_at: float | None = None

    def fault_injected(self, at: float) -> None:
        if self._failed_at is None:
            self._fault_at = at

    def observe(self, phase: str, epoch: int, restarts: int, whole: bool, now: float) -> None:
        """One status of the world. A restart counts a failure; a new epoch without one (a
        rollout, a resume, a spec edit) does not."""
        if restarts > self.restarts:
            self.failures += restarts - self.restarts
            if self._failed_at is None:
                recent = self._fault_at is not None and now - self._fault_at <= FAULT_ATTRIBUTION_S
                self._failed_at = self._fault_at if recent else now
            self._fault_at = None
        elif phase == "Failed" and self.phase != "Failed":
            # An exhausted restart budget: the world fails for good, at the epoch it had.
            self.failures += 1
        self.epoch, self.restarts, self.phase = epoch, restarts, phase
        if self._failed_at is not None and phase == "Running" and whole:
            self.recovery_seconds.append(round(now - self._failed_at, 3))
            self._failed_at = None

    def summary(self, phase: str, epoch: int, errors: int) -> WorldSummary:
        return WorldSummary(
            phase=phase,
            epoch=epoch,
            failures=self.failures,
            recoveries=len(self.recovery_seconds),
            recovery_seconds=self.recovery_seconds,
            errors=errors,
        )


class WorldTrackers:
    """A WorldTracker per world of a run."""

    def __init__(self, worlds: Iterable[str]) -> None:
        self.trackers = {world: WorldTracker() for world in worlds}

    def fault_injected(self, worlds: Iterable[str], at: float) -> None:
        for world in worlds:
            self.trackers[world].fault_injected(at)

    def observe(self, status: MultiWorldStatus, now: float) -> None:
        for name, ws in status.worlds.items():
            self.trackers[name].observe(ws.phase, ws.epoch, ws.restarts, ws.ready_ranks >= ws.size, now)

    def summary(
        self,
        multiworld: MultiWorld,
        status: MultiWorldStatus | None,
        errors_of: Callable[[str], int],
        orphans: int,
    ) -> RunSummary:
        worlds = {}
        for world in multiworld.spec.worlds:
            ws = status.worlds.get(world.name) if status else None
            worlds[world.name] = self.trackers[world.name].summary(
                phase=ws.phase if ws else "Pending", epoch=ws.epoch if ws else 1, errors=errors_of(world.name)
            )
        return RunSummary(worlds=worlds, orphans=orphans)
