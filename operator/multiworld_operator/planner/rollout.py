"""The template rollout (`spec.updateStrategy`).

- A running member pod made from an older template of its member is replaced by one of the
  current template (a ready spare of it plays the pod when there is one), while fewer than
  `maxUnavailable` member pods are not ready; a world whose old pods all fit in that room is
  taken whole, so it moves once. Each replaced pod's worlds get a new epoch (no restart
  counted). `paused` holds it. A pod of the new template that fails while old pods remain stops
  the rollout of its member (the failure policy counts as for any failure) until the member's
  template changes again.
- A rollout runs while a member pod is of an older template, and then until every member keeps
  its warm spares of the new template again (the refills are part of it: Progressing stays
  RollingOut). Meanwhile at most `maxSurge` spares start at once (spares.py).
"""

from __future__ import annotations

from multiworld_operator.planner.model import PodObservation
from multiworld_operator.planner.spares import Surge, short_of_spares, spare_counts
from multiworld_operator.planner.status import PodRecord, RolloutHalt
from multiworld_operator.planner.step import Step


def roll_out(step: Step) -> None:
    """Replace the outdated member pods the room allows (each recorded in `step.replaced`), and
    move each of their worlds that is up to a new epoch."""
    strategy = step.mw.spec.update_strategy
    # A member that keeps warm spares rolls only onto ready spares of its new template: each
    # pod then costs its worlds about one recovery, not a new pod's start.
    spares_left = {member: ready for member, (ready, _) in spare_counts(step).items()}
    outdated = []
    for pod in step.pods:
        member = step.mw.member_of_pod(pod)[0]
        if not _outdated(step, pod) or member in step.halted:
            continue
        if member in spares_left:
            if spares_left[member] == 0:
                continue
            spares_left[member] -= 1
        outdated.append(pod)
    if not outdated or strategy.paused or step.mw.spec.suspend:
        return
    room = strategy.max_unavailable - sum(_unavailable(step, p) for p in step.pods)
    old = set(outdated)  # sets: a world's pods are looked up in them once per world
    chosen: list[str] = []
    taken: set[str] = set()
    # Whole worlds first: a world whose old pods all fit in the room moves once.
    for world in step.mw.spec.worlds:
        pods = [p for p in step.worlds[world.name].pods if p in old and p not in taken]
        if pods and len(chosen) + len(pods) <= room:
            chosen += pods
            taken.update(pods)
    if not chosen and room > 0:
        chosen = outdated[:room]
    updating: set[str] = set()  # worlds the rollout moved to a new epoch in this step
    for pod in chosen:
        _update(step, pod, updating)


def refilling(step: Step) -> dict[str, tuple[int, int]]:
    """After its last pod was replaced, a rollout (the last status said RollingOut, or this step
    replaced pods for it) runs on while members are short of spares of their new template:
    those, with (ready, wanted)."""
    previous = step.previous.condition("Progressing")
    running = step.rolled_out or (previous is not None and previous.status == "True")
    return short_of_spares(step) if running else {}


def rollout_surge(step: Step) -> Surge | None:
    """While a rollout runs: its bound on spares starting at once, members with old pods first."""
    rolling = {step.mw.member_of_pod(pod)[0] for pod in step.pods if _outdated(step, pod)}
    if not rolling and not refilling(step):
        return None
    return Surge(at_once=step.mw.spec.update_strategy.max_surge, first=rolling)


def halt_if_new_template_failed(step: Step, pod: str, record: PodRecord, seen: PodObservation | None) -> None:
    """Member pod `pod`'s instance `record` failed: when it was of its member's new template
    while old pods remain, that member's rollout stops (a RolloutHalted Event)."""
    member = step.mw.member_of_pod(pod)[0]
    digest = step.mw.template_digest(member)
    rolling = any(_outdated(step, p) for p in step.mw.pods_of(member))
    if record.template == digest and rolling and member not in step.halted:
        why = f"pod {record.spare or pod} of member {member}'s new template failed" + (
            f": {seen.message}" if seen is not None and seen.message else ""
        )
        step.halted[member] = RolloutHalt(template=digest, reason=why)
        step.event("Warning", "RolloutHalted", None, f"rollout of member {member} stopped: {why}")


def updated_counts(step: Step) -> dict[str, tuple[int, int]]:
    """Per member: its pods not made from an older template (being made counts), and all."""
    counts = {}
    for member in step.mw.spec.members:
        pods = step.mw.pods_of(member.name)
        counts[member.name] = (sum(not _outdated(step, p) for p in pods), len(pods))
    return counts


def _outdated(step: Step, pod: str) -> bool:
    """Whether member pod `pod` runs an instance made from an older template of its member."""
    record = step.records.get(pod)
    if record is None or not record.observed or not record.template:
        return False
    return record.template != step.mw.template_digest(step.mw.member_of_pod(pod)[0])


def _unavailable(step: Step, pod: str) -> bool:
    """Whether member pod `pod` is not ready in one of its worlds that is up."""
    return any(step.worlds[w].up and not step.ready(pod, w, step.worlds[w].epoch) for w in step.pod_worlds[pod])


def _update(step: Step, pod: str, updating: set[str]) -> None:
    """Replace `pod` by an instance of its member's current template; each of its worlds that
    is up goes to a new epoch (no restart is counted) unless it is in `updating` already."""
    record = step.records.pop(pod)
    member = step.mw.member_of_pod(pod)[0]
    instance = record.spare or pod
    step.replaced[pod] = f"rolling out member {member}'s new template"
    step.rolled_out.append(pod)
    step.event("Normal", "PodUpdated", None, f"pod {instance} replaced by one of member {member}'s new template")
    for world in step.pod_worlds[pod]:
        state = step.worlds[world]
        if state.up and world not in updating:
            updating.add(world)
            state.epoch += 1
            state.phase, state.ready_ranks, state.epoch_started = "Pending", 0, step.now
            step.event("Normal", "WorldUpdating", world, f"world {world} moves to epoch {state.epoch} for the rollout")
