"""What a step leaves besides its actions: the next status (the overall phase, the conditions
Ready, Degraded, Progressing, Suspended and NodeLost, the counts `kubectl get mw` shows) and when to plan
again.
"""

from __future__ import annotations

from collections.abc import Sequence

from multiworld.contract import WorldTable
from multiworld_operator.planner.recovery import join_deadline, silent
from multiworld_operator.planner.rollout import refilling, updated_counts
from multiworld_operator.planner.spares import spare_counts
from multiworld_operator.planner.status import Condition, ConditionStatus, MultiWorldStatus, Phase, clipped
from multiworld_operator.planner.step import Step


def next_status(step: Step, table: WorldTable) -> MultiWorldStatus:
    """The planner's memory as `step` leaves it, with `table` the world table it publishes."""
    phases = [s.phase for s in step.worlds.values()]
    running = phases.count("Running")
    phase: Phase = "Suspended" if step.mw.spec.suspend else _overall_phase(phases)
    degraded = [n for n, s in step.worlds.items() if s.phase in ("Failed", "Recovering")]
    conditions = [
        _condition(
            step,
            "Ready",
            phase == "Running",
            "AllWorldsRunning" if phase == "Running" else f"Phase{phase}",
            f"{running}/{len(phases)} worlds running",
        ),
        _condition(
            step,
            "Degraded",
            bool(degraded),
            "WorldsUnhealthy" if degraded else "AllWorldsHealthy",
            ("not healthy: " + ", ".join(degraded)) if degraded else "no failed or recovering world",
        ),
    ]
    updated = updated_counts(step)
    progressing = _progressing(step, updated)
    if progressing is not None:
        conditions.append(progressing)
    if step.mw.spec.suspend or step.previous.condition("Suspended") is not None:
        suspended = step.mw.spec.suspend
        conditions.append(
            _condition(
                step,
                "Suspended",
                suspended,
                "SpecSuspend" if suspended else "Resumed",
                "spec.suspend is true: no pod runs; each world keeps its history"
                if suspended
                else "spec.suspend is false",
            )
        )
    lost = step.observation.lost_nodes
    if lost or step.previous.condition("NodeLost") is not None:
        told = "; ".join(f"node {node} at {at:%Y-%m-%dT%H:%M:%SZ}" for node, at in sorted(lost.items()))
        conditions.append(
            _condition(
                step,
                "NodeLost",
                bool(lost),
                "NodesLost" if lost else "NoNodeLost",
                clipped(f"lost: {told}; the pods there are replaced on other nodes") if lost else "no node lost lately",
            )
        )
    generation = step.mw.metadata.generation
    return MultiWorldStatus(
        phase=phase,
        observed_generation=generation if generation is not None else step.previous.observed_generation,
        worlds_ready=f"{running}/{len(phases)}",
        restarts=sum(s.restarts for s in step.worlds.values()),
        worlds=step.worlds,
        conditions=conditions,
        table=table,
        pods=step.records,
        played_by={pod: r.spare for pod, r in step.records.items() if r.spare},
        spares={member: f"{ready}/{wanted}" for member, (ready, wanted) in spare_counts(step).items()},
        spare_pool=step.pool,
        spare_serial=step.spare_serial,
        updated=f"{sum(counts[0] for counts in updated.values())}/{len(step.pods)}",
        rollout={m: f"{new}/{total}" for m, (new, total) in updated.items() if new < total},
        rollout_halted=step.halted,
    )


def requeue_after(step: Step) -> float | None:
    """Until the next backoff ends, or the next join timeout of a world with a silent pod."""
    waits = [(s.restart_at - step.now).total_seconds() for s in step.worlds.values() if s.restart_at]
    for name, state in step.worlds.items():
        deadline = join_deadline(step, name, state)
        if deadline is not None and any(silent(step, pod, name, state.epoch) for pod in state.pods):
            waits.append(max(0.0, (deadline - step.now).total_seconds()))
    return min(waits) if waits else None


def _progressing(step: Step, updated: dict[str, tuple[int, int]]) -> Condition | None:
    """While a rollout runs (or one ran before): what it does now."""
    rolling = [m for m, (new, total) in updated.items() if new < total]
    if not rolling and not step.rolled_out and step.previous.condition("Progressing") is None:
        return None
    short = {} if rolling else refilling(step)
    if short:
        left = ", ".join(f"{m} {ready}/{wanted}" for m, (ready, wanted) in short.items())
        return _condition(step, "Progressing", True, "RollingOut", f"warm spares of the new template: {left}")
    if not rolling:
        return _condition(
            step, "Progressing", False, "RolloutComplete", "every pod and warm spare is of its member's template"
        )
    halted = [f"{m}: {step.halted[m].reason}" for m in rolling if m in step.halted]
    if halted:
        return _condition(step, "Progressing", False, "RolloutHalted", "; ".join(halted))
    if step.mw.spec.update_strategy.paused:
        return _condition(step, "Progressing", False, "RolloutPaused", "spec.updateStrategy.paused is true")
    left = ", ".join(f"{m} {updated[m][0]}/{updated[m][1]}" for m in rolling)
    return _condition(step, "Progressing", True, "RollingOut", f"pods of the new template: {left}")


def _condition(step: Step, type_: str, true: bool, reason: str, message: str) -> Condition:
    status: ConditionStatus = "True" if true else "False"
    old = step.previous.condition(type_)
    since = old.last_transition_time if old is not None and old.status == status else step.now
    return Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=since)


def _overall_phase(phases: Sequence[str]) -> Phase:
    if phases and all(p == "Succeeded" for p in phases):
        return "Succeeded"
    if "Failed" in phases:
        return "Failed" if all(p in ("Failed", "Succeeded") for p in phases) else "Degraded"
    if "Recovering" in phases:
        return "Recovering"
    return "Pending" if "Pending" in phases else "Running"
