"""Spec edits: the worlds of the spec against those of the previous status.

- New worlds start at epoch 1, removed ones leave the table, a world whose expanded rank list or
  backend changed gets a new epoch; nothing else moves.
"""

from __future__ import annotations

from multiworld_operator.planner.status import WorldStatus
from multiworld_operator.planner.step import Step


def apply_spec(step: Step) -> None:
    """Fill `step.worlds` from the spec: the previous state of each world, edited as the spec
    now says (WorldAdded, WorldChanged, WorldRemoved Events)."""
    for world in step.mw.spec.worlds:
        pods, backend = step.mw.world_pods(world.name), step.backend_of(world.name)
        old = step.previous.worlds.get(world.name)
        if old is None:
            step.worlds[world.name] = WorldStatus(size=len(pods), pods=pods, backend=backend, epoch_started=step.now)
            if not step.first:
                step.event("Normal", "WorldAdded", world.name, f"world {world.name} added with {len(pods)} ranks")
            continue
        current = old.model_copy()
        if current.epoch_started is None:  # a status written before the field existed
            current.epoch_started = step.now
        if old.pods != pods or old.backend != backend:
            current.epoch += 1
            current.size, current.pods, current.backend = len(pods), pods, backend
            current.ready_ranks = 0
            if current.phase == "Failed":
                # An edited definition gets a fresh restart budget.
                current.restart_at = None
                current.forget_all_restarts()
            if current.restart_at is None:
                current.phase, current.epoch_started = "Pending", step.now
            step.event(
                "Normal",
                "WorldChanged",
                world.name,
                f"world {world.name} changed ({len(pods)} ranks, {backend}); now at epoch {current.epoch}",
            )
        step.worlds[world.name] = current
    for name in step.previous.worlds:
        if name not in step.worlds:
            step.event("Normal", "WorldRemoved", name, f"world {name} removed from the spec")
