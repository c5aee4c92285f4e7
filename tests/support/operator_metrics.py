"""The operator's real metrics (multiworld_operator.kube.metrics.registry) fed with statuses of a test's
choosing, for tests that scrape them without an operator running: `OperatorMetrics` reads them
through `FixedStatuses` as a replica reads the statuses it knows, and serves them on its real
HTTP endpoint. `planner_status` and `failure` build the planner's memory the steps compare."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from multiworld_operator.kube.metrics.registry import Key
from multiworld_operator.planner import MultiWorldStatus

T0 = datetime(2030, 1, 1, tzinfo=UTC)


class FixedStatuses:
    """A StatusSource (what the Controller is in the operator): `shown` by MultiWorld, as the
    CR's status shows it (None: no step yet)."""

    def __init__(self, shown: dict[Key, Mapping[str, Any] | None], leading: bool = True, waiting: int = 0) -> None:
        self.shown = shown
        self.leading = leading
        self._waiting = waiting

    def statuses(self) -> Iterable[tuple[Key, Mapping[str, Any] | None]]:
        return list(self.shown.items())

    def waiting(self) -> int:
        return self._waiting


def planner_status(size: int = 2, **worlds: dict[str, Any]) -> MultiWorldStatus:
    """A planner memory with these worlds (WorldStatus fields, camelCase), each of `size` ranks."""
    loaded = MultiWorldStatus.from_dict({"worlds": {name: {"size": size, **fields} for name, fields in worlds.items()}})
    assert loaded is not None
    return loaded


def failure(epoch: int, reason: str = "PodFailed", at: datetime = T0) -> dict[str, Any]:
    """A world's lastFailure: its epoch `epoch` ended at `at`."""
    return {"time": at.isoformat(), "reason": reason, "pod": "mw-a-0", "rank": 1, "epoch": epoch}
