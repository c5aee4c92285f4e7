"""MultiWorld: fault-isolated torch.distributed worlds."""

from multiworld.contract import (
    BrokenWorldReport,
    WorkerEnv,
    WorldAssignment,
    WorldTable,
)

__all__ = ["BrokenWorldReport", "WorkerEnv", "WorldAssignment", "WorldTable"]
