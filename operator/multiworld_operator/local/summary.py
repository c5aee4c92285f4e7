"""What `multiworld run` reports at the end: per world, failures, recoveries and their times,
planned changes and errors apart; and whether the run went well (every world ran, none
ended Failed)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from pydantic import BaseModel, Field

from multiworld_operator.planner import MultiWorldStatus
from multiworld_operator.spec import MultiWorld

# A kill counts as the start of the failure it causes if the world fails within this long.
FAULT_ATTRIBUTION_S = 10.0


class WorldSummary(BaseModel):
    phase: str
    epoch: int
    ran: bool  # Running (or Succeeded) at least once
    failures: int
    recoveries: int
    recovery_seconds: list[float] = Field(default_factory=list)
    planned_changes: int  # epochs moved on purpose: rollouts, suspends, spec edits
    errors: int  # errors raised to member code in this world, but for its planned changes


class RunSummary(BaseModel):
    worlds: dict[str, WorldSummary]
    orphans: int
    ok: bool  # every world ran and none ended Failed (else `multiworld run` exits 1)
    problems: list[str]  # why not ok, one line per world

    def render(self) -> str:
        lines = ["", "summary:"]
        for name, w in self.worlds.items():
            times = ", ".join(f"{s:.2f}s" for s in w.recovery_seconds) or "-"
            lines.append(
                f"  {name}: {w.phase} at epoch {w.epoch}; failures {w.failures}, "
                f"recoveries {w.recoveries} ({times}), planned changes {w.planned_changes}, errors {w.errors}"
            )
        lines.append(f"  orphan processes: {self.orphans}")
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines) + "\n"


class WorldTracker:
    """Follows one world's status over time to time its recoveries: from the failure (the
    injected kill when there was one) to the world Running again with every rank joined."""

    def __init__(self) -> None:
        self.epoch = 1
        self.restarts = 0
        self.phase = "Pending"
        self.ran = False
        self.failures = 0
        self.planned: set[int] = set()  # epochs the world left on purpose
        self.recovery_seconds: list[float] = []
        self._fault_at: float | None = None
        self._failed_at: float | None = None

    def fault_injected(self, at: float) -> None:
        if self._failed_at is None:
            self._fault_at = at

    def observe(self, phase: str, epoch: int, restarts: int, whole: bool, now: float) -> None:
        """One status of the world. A restart counts a failure; a new epoch without one (a
        rollout, a resume, a spec edit) is a planned change."""
        self.ran = self.ran or phase in ("Running", "Succeeded")
        if epoch > self.epoch and restarts == self.restarts:
            self.planned.update(range(self.epoch, epoch))
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

    def errors(self, breaks: Mapping[int, int]) -> int:
        """Of the breaks reported per epoch, those of epochs not left on purpose: a member
        whose world moves for a rollout or a suspend sees it break, and that is no error."""
        return sum(count for epoch, count in breaks.items() if epoch not in self.planned)

    def summary(self, phase: str, epoch: int, breaks: Mapping[int, int]) -> WorldSummary:
        return WorldSummary(
            phase=phase,
            epoch=epoch,
            ran=self.ran,
            failures=self.failures,
            recoveries=len(self.recovery_seconds),
            recovery_seconds=self.recovery_seconds,
            planned_changes=len(self.planned),
            errors=self.errors(breaks),
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

    def errors_of(self, world: str, breaks: Mapping[int, int]) -> int:
        """The errors of `world` so far, from the breaks reported per epoch."""
        return self.trackers[world].errors(breaks)

    def summary(
        self,
        multiworld: MultiWorld,
        status: MultiWorldStatus | None,
        breaks_of: Callable[[str], Mapping[int, int]],
        orphans: int,
    ) -> RunSummary:
        worlds = {}
        for world in multiworld.spec.worlds:
            ws = status.worlds.get(world.name) if status else None
            worlds[world.name] = self.trackers[world.name].summary(
                phase=ws.phase if ws else "Pending", epoch=ws.epoch if ws else 1, breaks=breaks_of(world.name)
            )
        problems = [f"world {name} never ran" for name, w in worlds.items() if not w.ran]
        problems += [f"world {name} ended Failed" for name, w in worlds.items() if w.phase == "Failed"]
        return RunSummary(worlds=worlds, orphans=orphans, ok=not problems, problems=problems)
