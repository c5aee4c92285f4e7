"""The pure decision: spec + previous status + observation -> Plan. No I/O, no clock.

The rules (docs/architecture.md, "Recovery semantics"), in short; each in full in the module
docstring of the part that implements it:
- Epochs and failures (recovery.py): every world has an epoch, 1 at first. A world that is up
  fails when one of its pods ends or disappears, or a worker reports it broken at its current
  epoch; it gets the next epoch at once and restarts now or after a backoff (staying in the
  table meanwhile), or is Failed for good once its window holds `maxRestarts` restarts. A pod
  that ends fails only the worlds whose current epoch it took part in.
- What a failure costs (recovery.py, `failurePolicy.replace`): `Pod` replaces only what is gone
  (a pod that ended, the culprit a live peer names, a kept pod silent `joinTimeout` after its
  epoch opened); `World` also replaces a failed world's live pods whose worlds all failed.
- Pods (pods.py): a pod exists while at least one of its worlds is up (or it finished); the
  rest are deleted.
- Spec edits (spec_edits.py): new worlds start at epoch 1, removed ones leave the table, a world
  whose rank list or backend changed gets a new epoch; nothing else moves.
- Suspend (suspend.py): every world that is up is Suspended (every pod goes, no failure);
  resuming gives each its next epoch.
- Rollout (rollout.py): pods of an older member template are replaced, `maxUnavailable` at a
  time, a whole world at once where it fits; a failing pod of the new template halts it.
- Warm spares (spares.py): a member pod that needs a new instance is played by a ready spare of
  its member's current template; the pool refills once the member pods have joined (while a
  rollout runs, `maxSurge` spares at a time).

`plan()` runs one `Step` (step.py: the working state every part reads and adds to) through the
parts in the order below; readiness.py says how far each world has come, table.py makes the
world table, outcome.py the next status and the requeue.
"""

from __future__ import annotations

from collections.abc import Callable

from multiworld.contract import Backend
from multiworld_operator.planner.model import Action, Endpoint, Observation, Plan, PublishTable
from multiworld_operator.planner.outcome import next_status, requeue_after
from multiworld_operator.planner.pods import reconcile_pods
from multiworld_operator.planner.readiness import count_ready, finish_worlds
from multiworld_operator.planner.recovery import recover
from multiworld_operator.planner.rollout import roll_out, rollout_surge
from multiworld_operator.planner.spares import assign_spares, keep_spares
from multiworld_operator.planner.spec_edits import apply_spec
from multiworld_operator.planner.status import MultiWorldStatus
from multiworld_operator.planner.step import Step
from multiworld_operator.planner.suspend import suspend_or_resume
from multiworld_operator.planner.table import build_table
from multiworld_operator.spec import MultiWorld


def plan(
    multiworld: MultiWorld,
    status: MultiWorldStatus | None,
    observation: Observation,
    *,
    endpoint: Endpoint,
    backend_of: Callable[[str], Backend] | None = None,
) -> Plan:
    """Decide the next step. `status` is the one the previous plan returned (None at first);
    `backend_of(world)` defaults to the cluster rule `multiworld.backend_of`."""
    step = Step(
        multiworld,
        status or MultiWorldStatus(),
        observation,
        endpoint,
        backend_of or multiworld.backend_of,
        first=status is None,
    )
    apply_spec(step)
    suspend_or_resume(step)
    recover(step)
    roll_out(step)
    finish_worlds(step)
    assign_spares(step)
    table = build_table(step)
    reconcile_pods(step, table)
    keep_spares(step, rollout_surge(step))
    count_ready(step)
    actions: list[Action] = [*step.deletes, *step.assigns]
    if table != step.previous.table:
        actions.append(PublishTable(table=table))
    actions += [*step.creates, *step.events]
    return Plan(actions=actions, status=next_status(step, table), requeue_after=requeue_after(step))
