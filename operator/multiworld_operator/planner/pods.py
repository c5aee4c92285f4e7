"""The pods against the plan: which to create and which to delete, with why.

- A pod exists while at least one of its worlds is up (or it finished); pods of Failed worlds
  only, of removed members, or unknown instances are deleted.
"""

from __future__ import annotations

from multiworld.contract import WorldTable
from multiworld_operator.planner.model import CreatePod, DeletePod, PodObservation
from multiworld_operator.planner.status import PodRecord
from multiworld_operator.planner.step import Step


def reconcile_pods(step: Step, table: WorldTable) -> None:
    """Ask for each member pod that a world that is up needs and that does not run (from `table`,
    its start-up assignments), and delete each pod that is not wanted as it runs."""
    for pod in step.pods:
        worlds = step.pod_worlds[pod]
        if all(step.worlds[w].phase == "Failed" for w in worlds):
            step.records.pop(pod, None)
        record, seen = step.records.get(pod), step.observed.get(pod)
        if seen is not None:
            if record is None or record.spare or seen.created_for != record.created_for:
                step.deletes.append(
                    DeletePod(pod=pod, reason=_delete_reason(step, seen, record), silent=pod in step.silent)
                )
            continue
        if record is None and any(step.worlds[w].up for w in worlds):
            record = PodRecord(
                created_for={w: step.worlds[w].epoch for w in worlds},
                template=step.mw.template_digest(step.mw.member_of_pod(pod)[0]),
            )
            step.records[pod] = record
        if record is not None and not record.observed:
            member, ordinal = step.mw.member_of_pod(pod)
            step.creates.append(
                CreatePod(
                    pod=pod,
                    member=member,
                    ordinal=ordinal,
                    created_for=record.created_for,
                    worlds=list(table.assignments_for(pod).values()),
                    template=step.mw.template_of(member),
                )
            )
    playing = {r.spare: pod for pod, r in step.records.items() if r.spare}
    for name in sorted(set(step.observed) - set(step.pod_worlds) - set(step.pool) - set(playing)):
        step.deletes.append(DeletePod(pod=name, reason=_stray_reason(step, name), silent=name in step.silent))


def _stray_reason(step: Step, name: str) -> str:
    """Why an observed pod that is no member pod, no pool spare and plays nothing goes."""
    played = next((pod for pod, r in step.previous.pods.items() if r.spare == name), None)
    if played is None:
        return "not part of the spec"
    return f"a warm spare that played {played}: " + (
        "failed" if step.observed[name].phase == "Failed" else "no longer needed"
    )


def _delete_reason(step: Step, seen: PodObservation, record: PodRecord | None) -> str:
    if record is not None and record.spare:
        return f"replaced by warm spare {record.spare}"
    if seen.name in step.replaced:
        return step.replaced[seen.name]
    if step.mw.spec.suspend:
        return "the MultiWorld is suspended (spec.suspend)"
    wanted = any(step.worlds[w].up for w in step.pod_worlds[seen.name])
    if seen.phase == "Failed":
        return "failed; replaced by a new instance" if wanted else "failed"
    if record is None and not wanted:
        return "no world of this pod is running"
    return "an outdated instance; replaced by a new one"
