"""The channel for a static environment: no live table, reports only logged."""

from __future__ import annotations

import logging

from multiworld.channels.base import TableCallback
from multiworld.contract import BrokenWorldReport, WorkerStatus
from multiworld.log_context import WorldLog

log = logging.getLogger(__name__)


class NoneChannel:
    def start(self, on_table: TableCallback) -> None:
        return None

    def report(self, report: BrokenWorldReport) -> None:
        WorldLog(log, report.world, report.epoch).info("broken: %s", report.reason)

    def status(self, status: WorkerStatus) -> None:
        log.debug("status: joined %s, errors %s", status.joined, status.errors)

    def close(self) -> None:
        return None


def from_url(url: str, pod: str) -> NoneChannel:
    return NoneChannel()
