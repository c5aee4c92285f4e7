"""Suspend and resume (`spec.suspend`).

- Every world that is not Failed or Succeeded is Suspended (out of the table, its epoch, history
  and restart budget kept), so every pod and spare goes; pods that go then are no failures.
  Resuming gives each suspended world its next epoch, and its pods are made anew.
"""

from __future__ import annotations

from multiworld_operator.planner.status import UP_PHASES
from multiworld_operator.planner.step import Step


def suspend_or_resume(step: Step) -> None:
    """Suspend every world that is up while `spec.suspend` holds (forgetting every pod), or
    resume every suspended world once it no longer does."""
    suspend = step.mw.spec.suspend
    for name, state in step.worlds.items():
        if suspend and state.phase in UP_PHASES:
            state.phase, state.restart_at, state.ready_ranks, state.waiting = "Suspended", None, 0, {}
            step.event("Normal", "WorldSuspended", name, f"world {name} suspended at epoch {state.epoch}")
        elif not suspend and state.phase == "Suspended":
            state.epoch += 1
            state.phase, state.epoch_started = "Pending", step.now
            step.event("Normal", "WorldResumed", name, f"world {name} resumed at epoch {state.epoch}")
    if suspend:
        # Every pod goes (none of them is a failure); the spare pool empties by its count.
        step.records.clear()
