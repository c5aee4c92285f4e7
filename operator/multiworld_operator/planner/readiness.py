"""How far each world that is up has come at its epoch: Succeeded once every rank finished,
its ready ranks, Running once all of them joined (WorldReady, or WorldRecovered after a failure;
`formed_at` the moment its last rank joined, by the workers' own clocks, where they say), and
while it forms, what its pods wait for (a WorldWaiting Event when that is more than a container
starting).
"""

from __future__ import annotations

from datetime import datetime

from multiworld_operator.planner.status import WorldStatus, clipped
from multiworld_operator.planner.step import Step
from multiworld_operator.spec.models import GPU_RESOURCE, gpus_per_pod


def finish_worlds(step: Step) -> None:
    """A world that is up and whose every pod finished is Succeeded."""
    for name, state in step.worlds.items():
        if state.up and all(step.finished(pod) for pod in state.pods):
            state.phase, state.ready_ranks = "Succeeded", 0
            step.event("Normal", "WorldSucceeded", name, f"world {name}: every rank finished")


def count_ready(step: Step) -> None:
    """Each world that is up: its ready ranks and waiting pods; Running once all are ready."""
    for name, state in step.worlds.items():
        if state.phase != "Running":
            state.formed_at = None  # the epoch it formed at, if any, is behind it
        if not state.up:
            continue
        state.ready_ranks = sum(step.ready(pod, name, state.epoch) for pod in state.pods)
        _note_waiting(step, name, state)
        if state.ready_ranks == state.size and state.phase != "Running":
            recovered = state.phase == "Recovering"
            how = "back" if recovered else "ready"
            step.event(
                "Normal",
                "WorldRecovered" if recovered else "WorldReady",
                name,
                f"world {name} {how} with all {state.size} ranks at epoch {state.epoch}",
            )
            state.phase = "Running"
        if state.phase == "Running" and state.formed_at is None:
            # Also later: a worker may say it joined after its Running pod was counted ready.
            state.formed_at = _formed_at(step, name, state)


def _formed_at(step: Step, name: str, state: WorldStatus) -> datetime | None:
    """When the last of the world's ranks joined it, by their workers' clocks (None: one of them
    did not say)."""
    times = []
    for pod in state.pods:
        seen = step.current(pod)
        if seen is None or seen.joined is None or seen.joined.get(name) != state.epoch:
            return None
        joined = seen.joined_at.get(name)
        if joined is None:
            return None
        times.append(joined)
    return max(times, default=None)


def _note_waiting(step: Step, name: str, state: WorldStatus) -> None:
    """The world's pods that are not running yet, with why; an Event once per epoch when one
    waits for a reason beyond a container starting (unschedulable, an image pull, ...)."""
    waiting = {}
    for pod in state.pods:
        seen = step.observed.get(step.playing(pod))
        if seen is None:
            waiting[pod] = "not created yet"
        elif seen.phase == "Pending":
            waiting[pod] = clipped(_with_ask(step, pod, seen.waiting or "Pending"))
    before = step.previous.worlds.get(name)
    told = (
        before is not None and before.epoch == state.epoch and any(_worth_telling(r) for r in before.waiting.values())
    )
    state.waiting = waiting
    stuck = {pod: reason for pod, reason in waiting.items() if _worth_telling(reason)}
    if stuck and not told:
        step.event(
            "Warning",
            "WorldWaiting",
            name,
            f"world {name} epoch {state.epoch} waits for "
            + "; ".join(f"pod {pod}: {reason}" for pod, reason in stuck.items()),
        )


def _with_ask(step: Step, pod: str, reason: str) -> str:
    """A pod the scheduler cannot place: its member, and the GPUs each of its pods asks for,
    beside the scheduler's words (which count nodes, not what was asked)."""
    head, sep, rest = reason.partition(": ")
    if head != "Unschedulable":
        return reason
    member, _ = step.mw.member_of_pod(pod)
    gpus = gpus_per_pod(step.mw.template_of(member))
    ask = f"member {member}" + (f", {gpus} {GPU_RESOURCE} a pod" if gpus else "")
    return f"{head} ({ask}){sep}{rest}"


# Why a pod waits while it simply starts: not worth an Event.
_STARTING = ("not created yet", "Pending", "ContainerCreating", "PodInitializing")


def _worth_telling(reason: str) -> bool:
    return not reason.startswith(_STARTING)
