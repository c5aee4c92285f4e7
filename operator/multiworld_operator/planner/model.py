"""What the planner reads (an Observation) and what it returns (a Plan of actions)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from multiworld.contract import BrokenWorldReport, WorkerEnv, WorldAssignment, WorldTable
from multiworld_operator.planner.status import MultiWorldStatus

PodPhase = Literal["Pending", "Running", "Succeeded", "Failed", "Missing"]
EventType = Literal["Normal", "Warning"]
# endpoint(world name, rank-0 pod name) -> (host, port) of that world's rendezvous store.
Endpoint = Callable[[str, str], tuple[str, int]]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PodObservation(_Model):
    """One pod as a platform sees it now. `created_for` is the stamp the planner gave the pod
    when it asked for it (CreatePod.created_for; platforms store it on the pod and read it
    back). `joined`, when the platform knows it (WorkerStatus.joined), is the epoch the pod's
    worker holds per world; None means unknown, and a Running pod then counts as joined."""

    name: str
    member: str
    ordinal: int = Field(ge=0)
    phase: PodPhase
    created_for: dict[str, int] = Field(default_factory=dict)
    joined: dict[str, int] | None = None
    # The epoch its worker is joining per world (WorkerStatus.joining), when the platform knows.
    joining: dict[str, int] = Field(default_factory=dict)
    # When its worker joined each world it holds, by the worker's own clock (WorkerStatus.joined_at).
    joined_at: dict[str, datetime] = Field(default_factory=dict)
    # Why a Failed pod ended, in its own words (a container's termination message), if it said.
    message: str = ""
    # Why a pod that is not Running yet waits (unschedulable, pulling its image, ...), if known.
    waiting: str = ""
    # When the platform first saw it running, by the platform's clock (the one reports are
    # stamped with on arrival), if it knows.
    started: datetime | None = None
    # A warm spare whose worker waits for an identity (WorkerStatus.waiting): ready to serve.
    warm: bool = False


class Observation(_Model):
    """Everything a platform saw since it last planned. A pod absent from `pods` (or with phase
    Missing) does not exist now."""

    now: datetime
    pods: list[PodObservation] = Field(default_factory=list)
    reports: list[BrokenWorldReport] = Field(default_factory=list)
    # Nodes the platform found lost lately with pods of this MultiWorld (their pods observed
    # Failed), and when: the status says so (the NodeLost condition).
    lost_nodes: dict[str, datetime] = Field(default_factory=dict)

    @field_validator("now")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("now must be timezone-aware (use datetime.now(timezone.utc))")
        return value


class CreatePod(_Model):
    """Create pod `pod` from `template` (already chosen for its member). `worlds` are its
    start-up assignments (its WorkerEnv); `created_for` must be stored on the pod and reported
    back in PodObservation.created_for. Creating a pod that already exists is a no-op.
    `spare`: a warm spare of the member (no ordinal, no worlds, `created_for` empty): its worker
    waits for an identity through the live table."""

    action: Literal["create"] = "create"
    pod: str
    member: str
    ordinal: int | None
    created_for: dict[str, int]
    worlds: list[WorldAssignment]
    template: dict[str, Any]
    spare: bool = False

    def worker_env(self, table: str = "") -> WorkerEnv:
        """The pod's environment contract; `table` is where its live world table comes from."""
        return WorkerEnv(pod=self.pod, worlds=self.worlds, table=table, spare=self.member if self.spare else "")


class AssignSpare(_Model):
    """Warm spare `pod` now plays member pod `plays`: the live table tells its worker, and
    `status.played_by` keeps it (the operator labels spares from there)."""

    action: Literal["assign"] = "assign"
    pod: str
    plays: str
    member: str
    ordinal: int


class DeletePod(_Model):
    """Delete pod `pod` (kill the process locally). Deleting a missing pod is a no-op."""

    action: Literal["delete"] = "delete"
    pod: str
    reason: str
    # Replaced for its silence (a live peer named it, or it did not join in time), not for an
    # exit: its host may be gone, so the platform places its replacement elsewhere if it can.
    silent: bool = False


class PublishTable(_Model):
    """Send this world table to every running worker (its revision grew)."""

    action: Literal["publish"] = "publish"
    table: WorldTable


class EmitEvent(_Model):
    """Record an event on the MultiWorld (`kubectl describe mw`); locally, show or log it.
    `world`: the world it is about, and `epoch` that world's epoch once the event was decided
    (a failure's event: the epoch it restarts at), for the operator's log line."""

    action: Literal["event"] = "event"
    type: EventType
    reason: str
    message: str
    world: str | None = None
    epoch: int | None = None


Action = Annotated[CreatePod | DeletePod | AssignSpare | PublishTable | EmitEvent, Field(discriminator="action")]


class Plan(_Model):
    """The planner's answer. Execute `actions` in order (deletes, spare assignments, the table,
    creates, events), store `status`, and plan again after `requeue_after` seconds (a
    restart waits for its backoff) or on the next change, whichever comes first."""

    actions: list[Action] = Field(default_factory=list)
    status: MultiWorldStatus
    requeue_after: float | None = None

    @property
    def table(self) -> WorldTable:
        return self.status.table

    @property
    def creates(self) -> list[CreatePod]:
        return [a for a in self.actions if isinstance(a, CreatePod)]

    @property
    def assigns(self) -> list[AssignSpare]:
        return [a for a in self.actions if isinstance(a, AssignSpare)]

    @property
    def deletes(self) -> list[DeletePod]:
        return [a for a in self.actions if isinstance(a, DeletePod)]

    @property
    def events(self) -> list[EmitEvent]:
        return [a for a in self.actions if isinstance(a, EmitEvent)]

    @property
    def publishes(self) -> list[PublishTable]:
        return [a for a in self.actions if isinstance(a, PublishTable)]
