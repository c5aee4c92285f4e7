"""The world table the workers read (PublishTable): every world that is Pending, Running or
Recovering, a world backing off included (its kept pods wait in its new epoch: see recovery.py),
at its epoch, with its pods as played now (a warm spare stands in its member pod's place) and
the epoch of that world each pod's instance was made for. The revision grows with every change.
"""

from __future__ import annotations

from multiworld.contract import WorldEntry, WorldTable
from multiworld_operator.planner.status import UP_PHASES
from multiworld_operator.planner.step import Step


def build_table(step: Step) -> WorldTable:
    entries = []
    for name, state in step.worlds.items():
        if state.phase in UP_PHASES:  # a world backing off included: see the module's docstring
            pods = [step.playing(pod) for pod in state.pods]
            host, port = step.endpoint(name, pods[0])
            entries.append(
                WorldEntry(
                    name=name,
                    epoch=state.epoch,
                    backend=state.backend,
                    host=host,
                    port=port,
                    pods=pods,
                    instances=_instances(step, name, state.pods),
                    plays={p: pod for p, pod in zip(pods, state.pods, strict=True) if p != pod},
                )
            )
    revision = step.previous.table.revision
    if entries != step.previous.table.worlds:
        revision += 1
    return WorldTable(revision=revision, worlds=entries)


def _instances(step: Step, world: str, pods: list[str]) -> dict[str, int]:
    """The epoch of `world` each pod's current instance was created for: a kept pod's record
    says; a pod without one (being replaced) gets an instance for the current epoch."""
    found = {}
    for pod in pods:
        record = step.records.get(pod)
        epoch = record.created_for.get(world) if record is not None else step.worlds[world].epoch
        if epoch is not None:
            found[step.playing(pod)] = epoch
    return found
