"""A logger of a test's own, not propagated, with one handler: its text and its records."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field


@dataclass
class Captured:
    logger: logging.Logger
    out: io.StringIO = field(default_factory=io.StringIO)
    records: list[logging.LogRecord] = field(default_factory=list)

    def lines(self) -> list[str]:
        return self.out.getvalue().splitlines()


def captured(name: str, fmt: str, *filters: logging.Filter) -> Captured:
    """`name`'s lines at every level, formatted by `fmt` after `filters`."""
    logger = logging.getLogger(name)
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    capture = Captured(logger)
    handler = logging.StreamHandler(capture.out)
    handler.setFormatter(logging.Formatter(fmt))
    for each in filters:
        handler.addFilter(each)

    def keep(record: logging.LogRecord) -> bool:
        capture.records.append(record)
        return True

    handler.addFilter(keep)
    logger.addHandler(handler)
    return capture
