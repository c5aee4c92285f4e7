"""The MultiWorld `status`: what `kubectl get/describe mw` shows, and the planner's memory.

The planner reads the previous status and returns the next one; platforms store it (the CR's
status subresource, or the local runner's memory) with `to_dict()` and read it back with
`MultiWorldStatus.from_dict(...)`. The CRD's status schema is generated from these models.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from multiworld.contract import Backend, WorldTable

WorldPhase = Literal["Pending", "Running", "Recovering", "Failed", "Succeeded"]
Phase = Literal["Pending", "Running", "Degraded", "Recovering", "Failed", "Succeeded"]
ConditionStatus = Literal["True", "False", "Unknown"]
# Phases in which a world is formed (or forming) at its epoch and listed in the world table.
UP_PHASES: frozenset[str] = frozenset({"Pending", "Running", "Recovering"})


class _StatusModel(BaseModel):
    # Unknown keys are ignored so a status written by a newer controller still loads.
    model_config = ConfigDict(extra="ignore", alias_generator=to_camel, populate_by_name=True)


class Failure(_StatusModel):
    """Why a world's epoch ended: `reason` is PodFailed, PodDeleted or WorldBroken."""

    time: datetime
    reason: str
    pod: str
    rank: int
    epoch: int
    message: str = ""


class WorldStatus(_StatusModel):
    phase: WorldPhase = "Pending"
    epoch: int = Field(default=1, ge=1)
    size: int = 0
    ready_ranks: int = 0
    restarts: int = 0
    last_failure: Failure | None = None
    # When a restart waits for its backoff: the world leaves the table until then.
    restart_at: datetime | None = None
    # Restarts still inside the failure policy's window (oldest first).
    recent_restarts: list[datetime] = Field(default_factory=list)
    # The rank list and backend this epoch was formed with; a spec edit that changes them
    # starts a new epoch.
    pods: list[str] = Field(default_factory=list)
    backend: Backend = "gloo"
    # While the world forms: its pods that are not running yet, with why they wait.
    waiting: dict[str, str] = Field(default_factory=dict)

    @property
    def up(self) -> bool:
        return self.phase in UP_PHASES and self.restart_at is None


class PodRecord(_StatusModel):
    """The pod instance the planner asked for: `createdFor` stamps it (the epoch of each of its
    worlds at creation); `observed` turns true once a platform reported that instance."""

    created_for: dict[str, int]
    observed: bool = False


class Condition(_StatusModel):
    type: str
    status: ConditionStatus
    reason: str
    message: str = ""
    last_transition_time: datetime


class MultiWorldStatus(_StatusModel):
    phase: Phase = "Pending"
    observed_generation: int | None = None
    worlds_ready: str = "0/0"
    restarts: int = 0
    worlds: dict[str, WorldStatus] = Field(default_factory=dict)
    conditions: list[Condition] = Field(default_factory=list)
    table: WorldTable = Field(default_factory=WorldTable)
    pods: dict[str, PodRecord] = Field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The CR's `status` (JSON-ready, camelCase keys)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def merge_patch(self, stored: Mapping[str, Any] | None) -> dict[str, Any]:
        """A JSON merge patch turning the `stored` status into this one. Keys this status no
        longer has (a removed world or pod record, a cleared restartAt) become null, which a
        merge patch needs to delete them; a plain `to_dict()` would leave them behind."""
        return _merge_patch(stored or {}, self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> MultiWorldStatus | None:
        """Read back a stored status; None (or an empty dict) means the planner has not run yet."""
        if not data or "worlds" not in data:
            return None
        return cls.model_validate(data)

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


def _merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            patch[key] = _merge_patch(before, value)
        else:
            patch[key] = value
    return patch
