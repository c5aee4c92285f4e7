"""MultiWorld: fault-isolated torch.distributed worlds.

`import multiworld` loads no torch, and importing any of its modules changes
nothing in the process (the exit hooks come with the first WorldManager). The light modules load
here; the runtime (`WorldManager`, `init_from_env`, `Work`) when first looked up, so that the
operator and the planner import `multiworld.contract` alone; torch loads with the first world
joined (or when `World` is first looked up). The worker never imports kubernetes: it needs no
Kubernetes API access (multiworld.channels.stream).
"""

from __future__ import annotations

import importlib
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
from multiworld.detect.config import DetectConfig
from multiworld.errors import (
    JoinTimedOut,
    MultiWorldError,
    StaleEpochError,
    UnknownWorldError,
    UnsupportedOpError,
    WorldBrokenError,
    WorldJoinError,
)
from multiworld.world.reduce_op import ReduceOp

if TYPE_CHECKING:
    from multiworld.manager import WorldManager
    from multiworld.membership.startup import init_from_env
    from multiworld.world.core import World
    from multiworld.world.work import Work

# Quiet unless the application configures logging.
logging.getLogger(__name__).addHandler(logging.NullHandler())

# Looked up on first use: name -> the module that defines it.
_LAZY = {
    "WorldManager": "multiworld.manager",
    "init_from_env": "multiworld.membership.startup",
    "Work": "multiworld.world.work",
    "World": "multiworld.world.core",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'multiworld' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The public names (the lazy ones included), as docs/library.md lists them."""
    return sorted(__all__)


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
