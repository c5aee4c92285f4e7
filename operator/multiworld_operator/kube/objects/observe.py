"""Pods as the API gives them -> what the planner observes (pure): `see_pod` reads one pod
(once per version of it: the pod cache keeps the result), `observe_pods` gathers them.

- Our instances: pods owned by this MultiWorld (by uid). A pod of an older MultiWorld of the
  same name (waiting for the garbage collector) is not ours, but it still holds its name.
- A pod being deleted is gone for the planner (a deleted pod is a failed one); it keeps its name
  until the API forgets it, so nothing is created in its place before then.
- `created_for` comes back from the pod's annotation; what its worker holds (WorkerStatus) and
  the reports the operator accepted from workers come from the worker channel (worker_inbox.py),
  never from anything a worker could write into the API.
- An instance lost with its host (its worker's channel got no acknowledgement: lost_hosts.py) has
  ended for the planner, whatever the API still says of it (Running, until Kubernetes notices
  the node): it is Failed, with the node and the moment in its message.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from multiworld.contract import BrokenWorldReport, WorkerStatus
from multiworld.per_source import QuietLog
from multiworld_operator.kube.objects.bodies import CREATED_FOR_ANNOTATION, MEMBER_LABEL, ORDINAL_LABEL, PLAYS_LABEL
from multiworld_operator.planner import PodObservation, PodPhase

log = logging.getLogger(__name__)

# The operator's own annotation is at most 15.1 KiB (the pod in most worlds of the largest
# accepted spec): a longer one is not ours, and is not parsed (a tenant may write 256 KiB).
MAX_ANNOTATION = 64 * 1024
# A tenant may write a pod's annotations as often as it likes: said once a minute per pod and key.
_ignored = QuietLog("pods", log)

_CREATED_FOR = TypeAdapter(dict[str, int])
_PHASES: dict[str, PodPhase] = {
    "Pending": "Pending",
    "Running": "Running",
    "Succeeded": "Succeeded",
    "Failed": "Failed",
    "Unknown": "Pending",
}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class OwnerRef(_Lenient):
    uid: str
    kind: str = ""
    name: str = ""
    controller: bool = False


class ObjectMeta(_Lenient):
    """The metadata of any object the operator reads (its pods, a Service, a NetworkPolicy)."""

    name: str
    uid: str = ""
    resource_version: str = Field(default="", alias="resourceVersion")
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    owner_references: list[OwnerRef] = Field(default_factory=list, alias="ownerReferences")
    deletion_timestamp: datetime | None = Field(default=None, alias="deletionTimestamp")

    @property
    def controller(self) -> OwnerRef | None:
        return next((ref for ref in self.owner_references if ref.controller), None)

    def owned_by(self, uid: str) -> bool:
        return self.controller is not None and self.controller.uid == uid


class Terminated(_Lenient):
    message: str = ""


class Waiting(_Lenient):
    reason: str = ""
    message: str = ""


class ContainerState(_Lenient):
    terminated: Terminated | None = None
    waiting: Waiting | None = None


class PodCondition(_Lenient):
    type: str = ""
    status: str = ""
    reason: str = ""
    message: str = ""


class ContainerStatus(_Lenient):
    state: ContainerState = Field(default_factory=ContainerState)


class PodSpecView(_Lenient):
    node_name: str = Field("", alias="nodeName")


class PodState(_Lenient):
    phase: str = "Pending"
    conditions: list[PodCondition] = Field(default_factory=list)
    container_statuses: list[ContainerStatus] = Field(default_factory=list, alias="containerStatuses")
    pod_ip: str = Field("", alias="podIP")

    @property
    def waiting(self) -> str:
        """Why a Pending pod waits: not scheduled, or a container not started (with the
        scheduler's or the kubelet's own words)."""
        for condition in self.conditions:
            if condition.type == "PodScheduled" and condition.status == "False":
                return ": ".join(part for part in (condition.reason or "Unscheduled", condition.message) if part)
        for status in self.container_statuses:
            if status.state.waiting is not None and status.state.waiting.reason:
                return ": ".join(part for part in (status.state.waiting.reason, status.state.waiting.message) if part)
        return ""

    @property
    def termination_message(self) -> str:
        """What the first container that ended with a message said (its termination message)."""
        return next(
            (
                s.state.terminated.message.strip()
                for s in self.container_statuses
                if s.state.terminated is not None and s.state.terminated.message.strip()
            ),
            "",
        )


class KubePod(_Lenient):
    """The fields of a Pod the operator reads."""

    metadata: ObjectMeta
    spec: PodSpecView = Field(default_factory=PodSpecView)
    status: PodState = Field(default_factory=PodState)


class ObservedPods(BaseModel):
    """One listing of a MultiWorld's pods, ready for the planner and the executor."""

    pods: list[PodObservation] = Field(default_factory=list)
    reports: list[BrokenWorldReport] = Field(default_factory=list)
    # Every pod name taken now (ours or not, terminating or not) -> that pod's uid.
    present: dict[str, str] = Field(default_factory=dict)
    # Our pods being deleted (with a grace period: a pod deleted at once is gone).
    terminating: set[str] = Field(default_factory=set)


class SeenPod(BaseModel):
    """One pod as the planner and the executor need it, read once per version of the pod."""

    model_config = ConfigDict(frozen=True)

    name: str
    uid: str
    # Ours and not being deleted: what the planner observes.
    observation: PodObservation | None = None
    # Ours and being deleted (with a grace period: a pod deleted at once is gone).
    terminating: bool = False
    # A warm spare's label: the member pod it plays ("" when it plays none, or is no spare).
    plays: str = ""
    # Its pod IP, once it has one: a peer's failed op may name it (worker_inbox.py).
    ip: str = ""
    # The node it was placed on, once it is (lost_hosts.py: a lost host's node is avoided).
    node: str = ""


def see_pod(item: Mapping[str, Any], owner_uid: str, running_since: datetime | None = None) -> SeenPod:
    """The pod as the planner observes it; `running_since`: when the operator first saw this
    instance Running, by its own clock (the one it stamps reports with: the kubelet's clock on
    another node is not comparable)."""
    pod = KubePod.model_validate(item)
    meta = pod.metadata
    if not meta.owned_by(owner_uid):
        return SeenPod(name=meta.name, uid=meta.uid)
    if meta.deletion_timestamp is not None:
        return SeenPod(name=meta.name, uid=meta.uid, terminating=True)
    observation = PodObservation(
        name=meta.name,
        member=meta.labels.get(MEMBER_LABEL, ""),
        ordinal=_ordinal(meta.labels.get(ORDINAL_LABEL)),
        phase=_PHASES.get(pod.status.phase, "Pending"),
        message=pod.status.termination_message,
        waiting=pod.status.waiting if pod.status.phase == "Pending" else "",
        started=running_since if pod.status.phase == "Running" else None,
        created_for=_annotation(meta, CREATED_FOR_ANNOTATION, _CREATED_FOR) or {},
    )
    return SeenPod(
        name=meta.name,
        uid=meta.uid,
        plays=meta.labels.get(PLAYS_LABEL, ""),
        ip=pod.status.pod_ip,
        node=pod.spec.node_name,
        observation=observation,
    )


def pod_addresses(pods: Iterable[SeenPod]) -> dict[str, str]:
    """Pod IP -> pod, for the IPs exactly one of the pods has (pods on the host's network share
    theirs: an address of one of them names none)."""
    holders: dict[str, list[str]] = {}
    for pod in pods:
        if pod.ip:
            holders.setdefault(pod.ip, []).append(pod.name)
    return {ip: names[0] for ip, names in holders.items() if len(names) == 1}


def observe_pods(
    pods: Iterable[SeenPod],
    workers: Mapping[str, WorkerStatus],
    reports: Iterable[BrokenWorldReport],
    *,
    silent_is_unjoined: bool = False,
    lost: Mapping[str, str] | None = None,
) -> ObservedPods:
    """The pods with what their workers hold (`workers`: pod uid -> its latest WorkerStatus, so a
    new instance of a pod never inherits its predecessor's), and the reports accepted. A pod whose
    worker said nothing counts as holding what the planner assumes of a program without the
    worker library (joined: unknown), unless `silent_is_unjoined` (an operator that just started,
    whose workers have not reconnected yet: it must not take them for joined). `lost`: pod uid ->
    why that instance is lost with its host; such a pod that has not ended is Failed, saying why."""
    seen = ObservedPods(reports=list(reports))
    for pod in pods:
        seen.present[pod.name] = pod.uid
        if pod.terminating:
            seen.terminating.add(pod.name)
        elif pod.observation is not None:
            worker = workers.get(pod.uid)
            observation = pod.observation
            if worker is not None:
                observation = observation.model_copy(
                    update={
                        "joined": dict(worker.joined),
                        "joining": dict(worker.joining),
                        "joined_at": dict(worker.joined_at),
                        "warm": worker.waiting,
                    }
                )
            elif silent_is_unjoined:
                observation = observation.model_copy(update={"joined": {}})
            why = (lost or {}).get(pod.uid)
            if why is not None and observation.phase in ("Pending", "Running"):
                observation = observation.model_copy(update={"phase": "Failed", "message": why})
            seen.pods.append(observation)
    return seen


def _ordinal(value: str | None) -> int:
    return int(value) if value is not None and value.isdigit() else 0


def _annotation(meta: ObjectMeta, key: str, shape: TypeAdapter[Any]) -> Any:
    """The annotation parsed as JSON of `shape`; None when absent or malformed (logged: a
    worker or a person wrote something the operator cannot read, and nothing else breaks)."""
    raw = meta.annotations.get(key)
    if raw is None:
        return None
    if len(raw) > MAX_ANNOTATION:
        _ignored.warn((meta.uid, key), "pod %s: ignoring annotation %s: %d characters", meta.name, key, len(raw))
        return None
    try:
        return shape.validate_json(raw)
    except ValidationError as error:
        _ignored.warn((meta.uid, key), "pod %s: ignoring annotation %s: %s", meta.name, key, error)
        return None
