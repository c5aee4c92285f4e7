"""The planner: every decision about a MultiWorld, as one pure function (no I/O, no clock).

Public API (stable; both platforms call it the same way):

    from multiworld_operator.planner import plan, Observation, PodObservation, Plan

    result = plan(multiworld, status, Observation(now=..., pods=[...], reports=[...]),
                  endpoint=lambda world, rank0_pod: (host, port),
                  backend_of=None)          # world -> 'nccl'|'gloo'; default: multiworld.backend_of
    for action in result.actions:           # in order: DeletePod, AssignSpare, PublishTable,
                                            # CreatePod, EmitEvent
        ...
    store(result.status)                    # MultiWorldStatus (the planner's memory): .to_dict()
                                            # all of it, .view() the CR's status; merge_patch(old,
                                            # new) the JSON merge patch between two such dicts
    result.table                            # contract.WorldTable for the workers (= status.table)
    result.requeue_after                    # seconds until a backoff or a join timeout ends, or None

- `status` is what the previous plan returned (`MultiWorldStatus.from_dict(stored)`), or
  None the first time. Re-planning the same observation is harmless: same status, no new epoch,
  only the still-pending creates/deletes repeated.
- `Observation.pods`: every pod of this MultiWorld that exists, with `created_for` read back
  from what CreatePod asked for (store it on the pod, e.g. as a JSON annotation) and, when
  known, `joined` (WorkerStatus.joined). A pod once observed and then absent counts as deleted.
- `Observation.reports`: BrokenWorldReports received; reports for other than a world's current
  epoch are ignored, so a platform may pass every report it still has.
- Status phases: overall Pending | Running | Degraded (some world Failed) | Recovering |
  Failed (no world left) | Succeeded (every world finished); per world Pending | Running |
  Recovering | Failed | Succeeded. Event reasons: WorldFailed, WorldExhausted (Warning);
  WorldRestarting, WorldRecovered, WorldReady, WorldSucceeded, WorldAdded, WorldChanged,
  WorldRemoved (Normal).
- `CreatePod.worker_env(table_url)` is the pod's WorkerEnv; `CreatePod.template` is its pod
  template. `DeletePod` of a pod that is gone, or `CreatePod` of one that exists, is a no-op.
"""

from multiworld_operator.planner.decide import plan
from multiworld_operator.planner.model import (
    Action,
    AssignSpare,
    CreatePod,
    DeletePod,
    EmitEvent,
    Endpoint,
    EventType,
    Observation,
    Plan,
    PodObservation,
    PodPhase,
    PublishTable,
)
from multiworld_operator.planner.status import (
    Condition,
    Failure,
    MultiWorldStatus,
    Phase,
    PodRecord,
    SpareRecord,
    StatusView,
    WorldPhase,
    WorldStatus,
    WorldView,
    merge_patch,
)

__all__ = [
    "Action",
    "AssignSpare",
    "Condition",
    "CreatePod",
    "DeletePod",
    "EmitEvent",
    "Endpoint",
    "EventType",
    "Failure",
    "MultiWorldStatus",
    "Observation",
    "Phase",
    "Plan",
    "PodObservation",
    "PodPhase",
    "PodRecord",
    "PublishTable",
    "SpareRecord",
    "StatusView",
    "WorldPhase",
    "WorldStatus",
    "WorldView",
    "merge_patch",
    "plan",
]
