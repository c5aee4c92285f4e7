"""MultiWorld: fault-isolated torch.distributed worlds.

`import multiworld` loads neither torch nor kubernetes: torch loads with the first world
joined (or when `World` is first looked up here), kubernetes only for its channel.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from multiworld.contract import (
    BrokenWorldReport,
    WorkerEnv,
    WorkerStatus,
    WorldAssignment,
    WorldEntry,
    WorldTable,
)
from multiworld.detect import DetectConfig
from multiworld.errors import (
    JoinTimedOut,
    MultiWorldError,
    StaleEpochError,
    UnknownWorldError,
    UnsupportedOpError,
    WorldBrokenError,
    WorldJoinError,
)
from multiworld.manager import WorldManager
from multiworld.reduce_op import ReduceOp
from multiworld.startup import init_from_env
from multiworld.work import Work

if TYPE_CHECKING:
    from multiworld.world import World

# Quiet unless the application configures logging.
logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    if name == "World":
        from multiworld.world import World

        return World
    raise AttributeError(f"module 'multiworld' has no attribute {name!r}")


__all__ = [
    "BrokenWorldReport",
    "DetectConfig",
    "JoinTimedOut",
    "MultiWorldError",
    "ReduceOp",
    "StaleEpochError",
    "UnknownWorldError",
    "UnsupportedOpError",
    "Work",
    "WorkerEnv",
    "WorkerStatus",
    "World",
    "WorldAssignment",
    "WorldBrokenError",
    "WorldEntry",
    "WorldJoinError",
    "WorldManager",
    "WorldTable",
    "init_from_env",
]
