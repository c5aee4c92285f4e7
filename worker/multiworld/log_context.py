"""Log lines bound once to the world and epoch they are about.

`WorldLog` is a logger for one world at one epoch (a `World`, a join, a judge of the failure
detector): each record carries `world` and `epoch` as attributes, for a structured formatter, and
its message ends with ` [world=NAME epoch=N]`, for a plain one. The operator logs under the same
keys (`multiworld_operator.log_context`), so one failure is followed from a worker's verdict to
the operator's step by `world=NAME`. Nothing shows unless the program configures logging.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any


class WorldLog(logging.LoggerAdapter[logging.Logger]):
    def __init__(self, logger: logging.Logger, world: str, epoch: int | None = None) -> None:
        super().__init__(logger, {"world": world, "epoch": epoch})

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        bound = dict(self.extra or {})
        kwargs["extra"] = {**bound, **kwargs.get("extra", {})}
        pairs = " ".join(f"{key}={value}" for key, value in bound.items() if value is not None)
        return f"{msg} [{pairs.replace('%', '%%')}]", kwargs
