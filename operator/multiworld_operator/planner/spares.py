"""Warm spares (`spares` of a member).

- That many pods of the member's template wait for an identity. A member pod that needs a new
  instance is played by the oldest ready spare of its member made from its current template
  (Running, its worker waiting), instead of a new pod of its name; with none ready, a new pod is
  created as without spares. A spare plays one member pod for the rest of its life, keeps its
  own name, and takes that pod's ranks in the table. A world whose store the pod hosted (its
  rank 0) at an epoch the table already published moves to the next epoch, with no restart
  counted. The pool refills once every member pod of a world that is up has joined it (spares
  would compete with them for the machine); spares of an older template, or beyond the count,
  are deleted. While a rollout runs, at most `updateStrategy.maxSurge` spares start at once,
  those of members with old pods first (rollout.py says when a rollout runs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

from multiworld_operator.planner.model import AssignSpare, CreatePod, DeletePod
from multiworld_operator.planner.status import UP_PHASES, PodRecord, SpareRecord
from multiworld_operator.planner.step import Step
from multiworld_operator.spec import spare_name


@dataclass(frozen=True)
class Surge:
    """A running rollout's bound on spares starting at once, and the members served first."""

    at_once: int
    first: Collection[str]


def spare_counts(step: Step) -> dict[str, tuple[int, int]]:
    """Per member that keeps spares: its spares of its current template ready to play one of
    its pods, and how many it wants now (one pass over the pool, which may still hold spares of
    a member the spec no longer has)."""
    wanted = {m.name: spares_wanted(step, m.name) for m in step.mw.spec.members if m.spares}
    ready = Counter(
        spare.member
        for name, spare in step.pool.items()
        if spare.member in wanted and _ready_spare(step, name, spare, spare.member)
    )
    return {member: (ready[member], count) for member, count in wanted.items()}


def spares_wanted(step: Step, member: str) -> int:
    """The member's `spares` while one of its worlds may still need a pod (is not Failed,
    Succeeded or Suspended); else none."""
    worlds = step.mw.worlds_of_member(member)
    return step.mw.member(member).spares if any(step.worlds[w].phase in UP_PHASES for w in worlds) else 0


def assign_spares(step: Step) -> None:
    """A member pod that needs a new instance is played by its member's oldest ready spare."""
    for pod in step.pods:
        worlds = step.pod_worlds[pod]
        if pod in step.records or not any(step.worlds[w].up for w in worlds):
            continue
        member, ordinal = step.mw.member_of_pod(pod)
        if not step.mw.member(member).spares:
            continue
        ready = sorted(
            (spare.serial, name) for name, spare in step.pool.items() if _ready_spare(step, name, spare, member)
        )
        if not ready:
            continue
        spare = ready[0][1]
        _move_stores_hosted_by(step, pod, spare)
        step.records[pod] = PodRecord(
            created_for={w: step.worlds[w].epoch for w in worlds},
            observed=True,
            spare=spare,
            template=step.pool.pop(spare).template,
        )
        step.assigns.append(AssignSpare(pod=spare, plays=pod, member=member, ordinal=ordinal))
        step.event("Normal", "SpareAssigned", None, f"warm spare {spare} plays {pod} (worlds {', '.join(worlds)})")


def _move_stores_hosted_by(step: Step, pod: str, spare: str) -> None:
    """A world whose store `pod` hosts (its rank 0) at an epoch the table already published
    moves to the next epoch: the spare serves the store under its own name, and a published
    epoch's entry never changes (its members would wait at the old host: a worker ignores such a
    change). The epoch had not formed (the pod's instance took no part in it, or the world would
    have failed with it), so this is no failure: no restart counted, no backoff."""
    published = {entry.name: entry.epoch for entry in step.previous.table.worlds}
    for world in step.pod_worlds[pod]:
        state = step.worlds[world]
        if state.phase in UP_PHASES and state.pods[0] == pod and published.get(world) == state.epoch:
            state.epoch += 1
            if state.restart_at is None:
                state.epoch_started = step.now
            step.event(
                "Normal",
                "WorldRestarting",
                world,
                f"world {world} moves to epoch {state.epoch}: warm spare {spare} serves its store in place of {pod}",
            )


def short_of_spares(step: Step) -> dict[str, tuple[int, int]]:
    """Members with fewer ready spares of their current template than they keep: (ready, wanted)."""
    return {m: (ready, wanted) for m, (ready, wanted) in spare_counts(step).items() if ready < wanted}


def keep_spares(step: Step, surge: Surge | None) -> None:
    """Each member's pool holds `spares` spares of its current template: gone or ended ones
    are dropped, outdated or surplus ones deleted, missing ones created (once no member pod
    is starting; with `surge`, no more than it allows starting at once)."""
    members = {m.name: m for m in step.mw.spec.members}
    wanted = {name: spares_wanted(step, name) for name, m in members.items() if m.spares}
    kept: dict[str, list[str]] = {name: [] for name in members}
    for name, spare in sorted(step.pool.items(), key=lambda item: item[1].serial):
        seen = step.observed.get(name)
        member = members.get(spare.member)
        why = None
        if seen is None and spare.observed:
            why = "gone"
        elif seen is not None and seen.phase in ("Failed", "Succeeded"):
            why = "a warm spare that ended before it played a member pod"
        elif member is None:
            why = f"a warm spare of member {spare.member}, no longer in the spec"
        elif spare.template != step.mw.template_digest(member.name):
            why = f"a warm spare of an older template of member {member.name}"
        elif len(kept[member.name]) >= wanted.get(member.name, 0):
            why = f"a warm spare beyond the {wanted.get(member.name, 0)} member {member.name} keeps now"
        if why is None:
            assert member is not None
            kept[member.name].append(name)
            spare.observed = spare.observed or seen is not None
            if seen is None:
                step.creates.append(_create_spare(step, name, member.name))
            continue
        del step.pool[name]
        if seen is not None:
            step.deletes.append(DeletePod(pod=name, reason=why))
    missing = {member: count - len(kept[member]) for member, count in wanted.items() if count > len(kept[member])}
    if not missing or _member_pods_starting(step):
        return
    room = sum(missing.values())
    if surge is not None:
        starting = sum(not _ready_spare(step, name, spare, spare.member) for name, spare in step.pool.items())
        room = min(room, surge.at_once - starting)
        missing = dict(sorted(missing.items(), key=lambda item: item[0] not in surge.first))
    for member_name, count in missing.items():
        for _ in range(count):
            if room <= 0:
                return
            room -= 1
            name = spare_name(step.mw.name, member_name, step.spare_serial)
            step.pool[name] = SpareRecord(
                member=member_name, template=step.mw.template_digest(member_name), serial=step.spare_serial
            )
            step.spare_serial += 1
            step.creates.append(_create_spare(step, name, member_name))


def _ready_spare(step: Step, name: str, spare: SpareRecord, member: str) -> bool:
    seen = step.observed.get(name)
    return (
        spare.member == member
        and spare.template == step.mw.template_digest(member)
        and seen is not None
        and seen.phase == "Running"
        and seen.warm
    )


def _create_spare(step: Step, name: str, member: str) -> CreatePod:
    return CreatePod(
        pod=name,
        member=member,
        ordinal=None,
        created_for={},
        worlds=[],
        template=step.mw.template_of(member),
        spare=True,
    )


def _member_pods_starting(step: Step) -> bool:
    """Whether a member pod of a world that is up has not joined it yet (a local process
    runs from the moment it is spawned: its imports are still ahead of it)."""
    for pod in step.pods:
        for world in step.pod_worlds[pod]:
            state = step.worlds[world]
            if state.up and not step.ready(pod, world, state.epoch):
                return True
    return False
