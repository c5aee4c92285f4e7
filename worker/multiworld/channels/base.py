"""How world tables reach a worker and how its reports leave: the channel protocol.

Every channel module exposes `from_url(url, pod) -> Channel`. `report` and `status` are
called from communicator and heartbeat threads, so they must never block: queue and return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from multiworld.contract import BrokenWorldReport, WorkerStatus, WorldTable

TableCallback = Callable[[WorldTable], None]


class Channel(Protocol):
    def start(self, on_table: TableCallback) -> None:
        """Begin delivering live world tables to `on_table` (on the channel's own thread)."""

    def report(self, report: BrokenWorldReport) -> None:
        """Tell the platform a world broke (non-blocking)."""

    def status(self, status: WorkerStatus) -> None:
        """Tell the platform what this process holds now (non-blocking)."""

    def close(self) -> None:
        """Flush briefly and stop."""
