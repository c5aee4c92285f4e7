"""The MultiWorld `status`: the planner's memory, and the part of it `kubectl get/describe mw`
shows.

The planner reads the previous `MultiWorldStatus` and returns the next one; platforms store it
whole with `to_dict()` and read it back with `MultiWorldStatus.from_dict(...)` (the local runner
in its memory, the operator in a ConfigMap of its own). `view()` is the part written to the CR's
status subresource: every world's phase, epoch, size, ready ranks, restarts and last failure, and
the conditions; its size grows by a few dozen bytes per world, so a MultiWorld of thousands of
worlds stays well inside etcd's object limit. The CRD's status schema is generated from
`StatusView`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from multiworld.contract import Backend, WorldTable

WorldPhase = Literal["Pending", "Running", "Recovering", "Failed", "Succeeded", "Suspended"]
Phase = Literal["Pending", "Running", "Degraded", "Recovering", "Failed", "Succeeded", "Suspended"]
ConditionStatus = Literal["True", "False", "Unknown"]
# A world's restart history: its last RECENT_RESTARTS restarts in the window exactly, the older
# ones counted per slot of window / RESTART_SLOTS (so the history stays a few hundred bytes
# however many restarts the policy allows).
RECENT_RESTARTS = 16
RESTART_SLOTS = 32
# Phases in which a world is formed (or forming) at its epoch and listed in the world table.
UP_PHASES: frozenset[str] = frozenset({"Pending", "Running", "Recovering"})
# The longest message the status keeps per world or per pod (why a world failed, why a pod
# waits), as the spec's caps on worlds and ranks assume it (spec/limits.py); the reasons of
# workers' reports are taken at this length too.
MAX_MESSAGE = 128
# A world's last failure quotes the failed pod's termination message, whose opening says what
# went wrong and how to fix it: room for the longest the worker writes itself (a refused
# permission and its fix) after the pod's name and rank.
MAX_FAILURE_MESSAGE = 384
# A condition's message (a few per MultiWorld: room for a list of world names, cut beyond).
MAX_CONDITION_MESSAGE = 1024
CUT_MARK = " [...]"


def clipped(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text`, or its first characters and CUT_MARK when it is longer than `limit`: a message
    the status keeps (a termination message, a report's reason) never outgrows the sizes the
    spec's caps were derived for."""
    return text if len(text) <= limit else text[: limit - len(CUT_MARK)] + CUT_MARK


# Texts the status keeps per world or per pod, and per condition: cut when set or loaded.
Message = Annotated[str, AfterValidator(clipped)]
FailureMessage = Annotated[str, AfterValidator(lambda text: clipped(text, MAX_FAILURE_MESSAGE))]
ConditionMessage = Annotated[str, AfterValidator(lambda text: clipped(text, MAX_CONDITION_MESSAGE))]


class _StatusModel(BaseModel):
    # Unknown keys are ignored so a status written by a newer controller still loads.
    model_config = ConfigDict(extra="ignore", alias_generator=to_camel, populate_by_name=True)


class Failure(_StatusModel):
    """Why a world's epoch ended: `reason` is PodFailed, PodDeleted, WorldBroken or PodReplaced
    (a pod it shares with another world was replaced for that world)."""

    time: datetime
    reason: str
    pod: str
    rank: int
    epoch: int
    message: FailureMessage = ""


class RestartSlot(_StatusModel):
    """`count` restarts within one slot of the window, the newest of them at `last`. A slot
    leaves the window when its newest restart does: its older ones count at most a slot's
    width (window / RESTART_SLOTS) longer than they would one by one."""

    last: datetime
    count: int = Field(ge=1)


class WorldView(_StatusModel):
    """One world as the CR's status shows it."""

    phase: WorldPhase = "Pending"
    epoch: int = Field(default=1, ge=1)
    size: int = 0
    ready_ranks: int = 0
    restarts: int = 0
    last_failure: Failure | None = None
    # When a restart waits for its backoff: its new pods are made only then (the table already
    # lists its new epoch, which its kept pods wait in).
    restart_at: datetime | None = None
    # While the world forms: its pods that are not running yet, with why they wait.
    waiting: dict[str, Message] = Field(default_factory=dict)
    # When its last rank joined the current epoch, by that worker's own clock (where workers say).
    formed_at: datetime | None = None


class WorldStatus(WorldView):
    """One world in the planner's memory."""

    # Restarts still inside the failure policy's window (oldest first): the last RECENT_RESTARTS
    # one by one, the older ones per slot (restarts_within, with_restart).
    recent_restarts: list[datetime] = Field(default_factory=list)
    earlier_restarts: list[RestartSlot] = Field(default_factory=list)
    # When the current epoch opened (a failure, a spec edit, a backoff's end): a kept pod that
    # has not joined it `joinTimeout` later is replaced.
    epoch_started: datetime | None = None
    # The rank list and backend this epoch was formed with; a spec edit that changes them
    # starts a new epoch.
    pods: list[str] = Field(default_factory=list)
    backend: Backend = "gloo"

    @property
    def up(self) -> bool:
        return self.phase in UP_PHASES and self.restart_at is None

    def restarts_within(self, since: datetime) -> int:
        """How many restarts the history holds after `since` (a slot counts whole while its
        newest restart is after it)."""
        return sum(slot.count for slot in self.earlier_restarts if slot.last > since) + sum(
            1 for t in self.recent_restarts if t > since
        )

    def forget_restarts(self, since: datetime) -> None:
        """Drop the restarts at or before `since` (they left the window); new lists, never
        edits in place (a copied status shares them with the one it was copied from)."""
        self.earlier_restarts = [slot for slot in self.earlier_restarts if slot.last > since]
        self.recent_restarts = [t for t in self.recent_restarts if t > since]

    def with_restart(self, now: datetime, window_seconds: float) -> None:
        """Add a restart at `now`: the oldest of more than RECENT_RESTARTS go into the slot of
        width window / RESTART_SLOTS they fall in (aligned on the epoch), at most
        2 * RESTART_SLOTS slots (beyond, after the window shrank, the two oldest merge)."""
        recent = [*self.recent_restarts, now]
        slots = list(self.earlier_restarts)
        width = window_seconds / RESTART_SLOTS
        while len(recent) > RECENT_RESTARTS:
            moved, recent = recent[0], recent[1:]
            if slots and width > 0 and _slot(slots[-1].last, width) == _slot(moved, width):
                slots[-1] = RestartSlot(last=moved, count=slots[-1].count + 1)
            else:
                slots.append(RestartSlot(last=moved, count=1))
        while len(slots) > 2 * RESTART_SLOTS:
            slots[:2] = [RestartSlot(last=slots[1].last, count=slots[0].count + slots[1].count)]
        self.recent_restarts, self.earlier_restarts = recent, slots

    def forget_all_restarts(self) -> None:
        self.recent_restarts, self.earlier_restarts = [], []


class PodRecord(_StatusModel):
    """The pod instance the planner asked for: `createdFor` stamps it (the epoch of each of its
    worlds at creation); `observed` turns true once a platform reported that instance. `spare`:
    the warm spare pod that plays this member pod (None: a pod of the member pod's own name)."""

    created_for: dict[str, int]
    observed: bool = False
    spare: str | None = None
    # A digest of the member template the instance was made from ("": not known, taken as the
    # current one): an older one is replaced by a rollout.
    template: str = ""


class SpareRecord(_StatusModel):
    """A warm spare pod the planner asked for and that plays no member pod yet: its member, a
    digest of the template it was made from (it serves only that), its serial (oldest serves
    first), and `observed` once a platform reported it."""

    member: str
    template: str
    serial: int
    observed: bool = False


class RolloutHalt(_StatusModel):
    template: str
    reason: Message


class Condition(_StatusModel):
    type: str
    status: ConditionStatus
    reason: str
    message: ConditionMessage = ""
    last_transition_time: datetime


class StatusView(_StatusModel):
    """The CR's `status`."""

    phase: Phase = "Pending"
    observed_generation: int | None = None
    worlds_ready: str = "0/0"
    restarts: int = 0
    # One field for server-side field tracking: per-key tracking would add managedFields
    # entries as large as the worlds themselves.
    worlds: dict[str, WorldView] = Field(default_factory=dict, json_schema_extra={"x-kubernetes-map-type": "atomic"})
    conditions: list[Condition] = Field(default_factory=list)
    # Member pod -> the warm spare pod that plays it (only those a spare plays).
    played_by: dict[str, str] = Field(default_factory=dict)
    # Member -> "<ready>/<wanted>" warm spares (only members with spec.members[].spares).
    spares: dict[str, str] = Field(default_factory=dict)
    # Member pods made from their member's current template / all member pods; per member while
    # a rollout runs.
    updated: str = "0/0"
    rollout: dict[str, str] = Field(default_factory=dict)


class MultiWorldStatus(StatusView):
    """The planner's memory: the view, every world's formation and restart history, the live
    world table, and a record per pod instance the planner asked for."""

    # A WorldStatus is a WorldView: pydantic narrows the field (mypy sees dict's invariance).
    worlds: dict[str, WorldStatus] = Field(default_factory=dict)  # type: ignore[assignment]
    table: WorldTable = Field(default_factory=WorldTable)
    pods: dict[str, PodRecord] = Field(default_factory=dict)
    # Warm spares that play no member pod yet, by pod name; the serial of the next one.
    spare_pool: dict[str, SpareRecord] = Field(default_factory=dict)
    spare_serial: int = 0
    # Member -> the template digest whose rollout stopped itself (a pod of it failed), and why.
    rollout_halted: dict[str, RolloutHalt] = Field(default_factory=dict)

    def played_by_pod(self, pod: str) -> str:
        """The pod that plays member pod `pod` now: a warm spare, or the pod of that name."""
        return played_by(self.pods, pod)

    def to_dict(self) -> dict[str, Any]:
        """All of it, JSON-ready with camelCase keys."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def view(self) -> dict[str, Any]:
        """The CR's `status`: the memory less the table, the pod records and each world's
        formation and restart history; `waiting` only while a world waits."""
        view = self.model_dump(mode="json", by_alias=True, exclude_none=True, exclude=_NOT_VIEWED)
        for world in view["worlds"].values():
            if not world["waiting"]:
                del world["waiting"]
        for key in ("playedBy", "spares", "rollout"):
            if not view[key]:
                del view[key]
        return view

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> MultiWorldStatus | None:
        """Read back a stored status; None (or an empty dict) means the planner has not run yet."""
        if not data or "worlds" not in data:
            return None
        return cls.model_validate(data)

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


def _slot(time: datetime, width: float) -> int:
    return int((time - _EPOCH) / timedelta(seconds=width))


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def played_by(records: Mapping[str, PodRecord], pod: str) -> str:
    """The pod that plays member pod `pod` by these records: a warm spare, or the pod of that name."""
    record = records.get(pod)
    return record.spare if record is not None and record.spare else pod


def _history_fields() -> set[str]:
    """The fields of a world that only the planner's memory holds (formation and restart history)."""
    # A function, not an expression at the top level: mypy can defer a function body until it
    # knows pydantic's `model_fields`, and in some orders of its analysis it does not know it there.
    return set(WorldStatus.model_fields) - set(WorldView.model_fields)


_NOT_VIEWED: Any = {
    "table": True,
    "pods": True,
    "spare_pool": True,
    "spare_serial": True,
    "rollout_halted": True,
    "worlds": {"__all__": _history_fields()},
}


def merge_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch turning `old` into `new`. Keys `new` no longer has (a removed world, a
    cleared restartAt) become null, which a merge patch needs to delete them."""
    return _merge_patch(old or {}, new)


def _merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if key in old and value == before:
            continue
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            patch[key] = _merge_patch(before, value)
        else:
            patch[key] = value
    return patch
