"""One planning step: what the planner was given, what it has decided so far, and the questions
every part of it asks (which instance plays a member pod, whether it joined its world).

`plan()` (decide.py) makes a `Step` and hands it to each part in turn (spec edits, suspend,
recovery, rollout, readiness, spares, the table, the pods, the outcome); each part reads it and
adds to it. The step starts from shallow copies of the previous status: a part assigns fields of
its worlds and records, and never changes a list or dict it holds in place, so the previous
status stays as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from multiworld.contract import Backend, BrokenWorldReport
from multiworld_operator.planner.model import (
    AssignSpare,
    CreatePod,
    DeletePod,
    EmitEvent,
    Endpoint,
    EventType,
    Observation,
    PodObservation,
)
from multiworld_operator.planner.status import (
    MultiWorldStatus,
    PodRecord,
    RolloutHalt,
    SpareRecord,
    WorldStatus,
    played_by,
)
from multiworld_operator.spec import MultiWorld


@dataclass(eq=False)
class Step:
    """The planner's working state for one observation. `first`: there is no previous status
    (the worlds of the spec are not "added" then)."""

    mw: MultiWorld
    previous: MultiWorldStatus
    observation: Observation
    endpoint: Endpoint
    backend_of: Callable[[str], Backend]
    first: bool

    # The spec's member pods and each one's worlds; the pods that exist now, by name.
    pods: list[str] = field(init=False)
    pod_worlds: dict[str, list[str]] = field(init=False)
    observed: dict[str, PodObservation] = field(init=False)
    # The planner's memory as this step leaves it: the pod instances asked for (member pods of the
    # spec only), the warm spares that play no member pod yet, the rollouts that stopped
    # themselves, the worlds (filled by the spec edits), the serial of the next spare.
    records: dict[str, PodRecord] = field(init=False)
    pool: dict[str, SpareRecord] = field(init=False)
    halted: dict[str, RolloutHalt] = field(init=False)
    worlds: dict[str, WorldStatus] = field(init=False, default_factory=dict)
    spare_serial: int = field(init=False)

    # The actions decided, by kind (plan() orders them).
    deletes: list[DeletePod] = field(init=False, default_factory=list)
    assigns: list[AssignSpare] = field(init=False, default_factory=list)
    creates: list[CreatePod] = field(init=False, default_factory=list)
    events: list[EmitEvent] = field(init=False, default_factory=list)
    # Member pods whose instance this step replaces, with why (recovery, rollout).
    replaced: dict[str, str] = field(init=False, default_factory=dict)
    # Instances (a member pod, or the spare playing it) this step replaces for their silence.
    silent: set[str] = field(init=False, default_factory=set)
    # Member pods this step replaces for the rollout.
    rolled_out: list[str] = field(init=False, default_factory=list)

    # Per pod: the record last compared with its observed instance, and whether they match.
    # A pod shared by every world carries a stamp per world: comparing it once per world would
    # make a step quadratic in the worlds.
    _matches: dict[str, tuple[PodRecord, bool]] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        previous, mw = self.previous, self.mw
        self.pods = mw.all_pods()
        self.pod_worlds = {pod: mw.worlds_of_pod(pod) for pod in self.pods}
        self.observed = {p.name: p for p in self.observation.pods if p.phase != "Missing"}
        self.records = {n: r.model_copy() for n, r in previous.pods.items() if n in self.pod_worlds}
        self.pool = {n: r.model_copy() for n, r in previous.spare_pool.items()}
        # A halted rollout stays halted until its member's template changes again.
        members = {m.name for m in mw.spec.members}
        self.halted = {
            m: h for m, h in previous.rollout_halted.items() if m in members and h.template == mw.template_digest(m)
        }
        self.spare_serial = previous.spare_serial

    @property
    def now(self) -> datetime:
        return self.observation.now

    @property
    def reports(self) -> list[BrokenWorldReport]:
        return self.observation.reports

    def event(self, type_: EventType, reason: str, world: str | None, message: str) -> None:
        state = self.worlds.get(world) if world is not None else None
        epoch = state.epoch if state is not None else None
        self.events.append(EmitEvent(type=type_, reason=reason, world=world, epoch=epoch, message=message))

    def playing(self, pod: str) -> str:
        """The pod that plays member pod `pod` now: a warm spare, or the pod of that name."""
        return played_by(self.records, pod)

    def current(self, pod: str) -> PodObservation | None:
        """The pod as observed, when it is the instance its record asked for."""
        record = self.records.get(pod)
        if record is None:
            return None
        seen = self.observed.get(record.spare or pod)
        if seen is None:
            return None
        known = self._matches.get(pod)
        if known is None or known[0] is not record:
            # A spare's name is never reused: the pod of that name is the one that was assigned.
            known = (record, record.spare is not None or seen.created_for == record.created_for)
            self._matches[pod] = known
        return seen if known[1] else None

    def ready(self, pod: str, world: str, epoch: int) -> bool:
        """Whether member pod `pod`'s instance runs and joined `world` at `epoch` (unknown: yes)."""
        seen = self.current(pod)
        if seen is None or seen.phase != "Running":
            return False
        return seen.joined is None or seen.joined.get(world) == epoch

    def finished(self, pod: str) -> bool:
        seen = self.current(pod)
        return seen is not None and seen.phase == "Succeeded"
