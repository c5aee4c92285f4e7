"""A worker's lines about a world carry its world and epoch, bound once (issue 35 item 7)."""

from __future__ import annotations

import pytest

from multiworld.log_context import WorldLog
from tests.support.log_capture import captured

pytestmark = pytest.mark.quick

PLAIN = "%(levelname)s %(message)s"


def test_a_line_ends_with_its_world_and_epoch_and_its_record_carries_them() -> None:
    capture = captured(f"{__name__}.bound", PLAIN)
    log = WorldLog(capture.logger, "w1", 3)
    log.warning("rank %d went silent (%s)", 1, "100% of its beats missed")
    log.info("joined", extra={"rank": 0})
    assert capture.lines() == [
        "WARNING rank 1 went silent (100% of its beats missed) [world=w1 epoch=3]",
        "INFO joined [world=w1 epoch=3]",
    ]
    assert [(r.world, r.epoch) for r in capture.records] == [("w1", 3), ("w1", 3)]  # type: ignore[attr-defined]
    assert capture.records[1].rank == 0  # type: ignore[attr-defined]


def test_a_world_without_an_epoch_names_the_world_alone() -> None:
    capture = captured(f"{__name__}.world", PLAIN)
    WorldLog(capture.logger, "w%2", None).debug("serving its store on port %d", 29500)
    assert capture.lines() == ["DEBUG serving its store on port 29500 [world=w%2]"]
