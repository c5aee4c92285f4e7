import asyncio
import io
from pathlib import Path

import pytest

from multiworld.contract import BrokenWorldReport
from multiworld_operator.local.launcher import MemberLauncher
from multiworld_operator.local.pod_processes import PodProcesses
from multiworld_operator.local.summary import WorldTracker
from multiworld_operator.local.view import LiveView, WorldRow, format_table

pytestmark = pytest.mark.quick


def test_recovery_is_timed_from_the_injected_kill_to_all_ranks_back():
    tracker = WorldTracker()
    tracker.observe("Running", 1, 0, True, now=1.0)
    tracker.fault_injected(10.0)
    tracker.observe("Recovering", 2, 1, False, now=10.1)
    tracker.observe("Running", 2, 1, False, now=11.0)  # not every rank joined yet
    tracker.observe("Running", 2, 1, True, now=12.5)
    summary = tracker.summary("Running", 2, breaks={})
    assert summary.failures == 1 and summary.recoveries == 1
    assert summary.recovery_seconds == [2.5]


def test_failure_without_injection_is_timed_from_when_it_was_seen():
    tracker = WorldTracker()
    tracker.observe("Recovering", 3, 2, False, now=5.0)  # two restarts at once: two failures
    tracker.observe("Running", 3, 2, True, now=6.0)
    summary = tracker.summary("Running", 3, breaks={3: 4})
    assert (summary.failures, summary.recovery_seconds, summary.errors) == (2, [1.0], 4)


@pytest.mark.parametrize(
    ("then", "failures"),
    [
        # Out of restarts, a world goes Failed at the epoch it had: that failure counts too.
        ([("Failed", 1), ("Failed", 1)], 1),
        # A rollout, a resume or a spec edit moves the epoch and restarts nothing.
        ([("Pending", 2), ("Running", 2)], 0),
    ],
    ids=["exhausted world: its last failure once", "new epoch without a restart: no failure"],
)
def test_failures_counted_after_a_run(then: list[tuple[str, int]], failures: int) -> None:
    tracker = WorldTracker()
    tracker.observe("Running", 1, 0, True, now=1.0)
    for now, (phase, epoch) in enumerate(then, start=2):
        tracker.observe(phase, epoch, 0, phase == "Running", now=float(now))
    phase, epoch = then[-1]
    summary = tracker.summary(phase, epoch, breaks={})
    assert (summary.failures, summary.recoveries) == (failures, 0)


def test_planned_changes_and_the_breaks_they_cost_are_apart_from_failures_and_errors() -> None:
    """Epoch 1 ends in a rollout (no restart), epoch 2 in a failure, epoch 3 in a suspend's
    resume: two planned changes, one failure; only epoch 2's breaks are errors."""
    tracker = WorldTracker()
    tracker.observe("Running", 1, 0, True, now=1.0)
    tracker.observe("Pending", 2, 0, False, now=2.0)  # rollout
    tracker.observe("Running", 2, 0, True, now=3.0)
    tracker.observe("Recovering", 3, 1, False, now=4.0)  # failure
    tracker.observe("Running", 3, 1, True, now=5.0)
    tracker.observe("Running", 4, 1, True, now=6.0)  # suspended and resumed between two looks
    summary = tracker.summary("Running", 4, breaks={1: 2, 2: 3, 3: 1})
    assert (summary.planned_changes, summary.failures, summary.errors) == (2, 1, 3)
    assert summary.ran


def test_a_world_seen_only_pending_never_ran() -> None:
    tracker = WorldTracker()
    tracker.observe("Pending", 1, 0, False, now=1.0)
    assert not tracker.summary("Pending", 1, breaks={}).ran


def test_live_table_columns_line_up():
    lines = format_table([WorldRow("world1", "Running", 2, 3, 3, 1, 0), WorldRow("w2", "Recovering", 10, 1, 3, 9, 12)])
    assert lines[0].split() == ["WORLD", "PHASE", "EPOCH", "RANKS", "UP", "RESTARTS", "ERRORS"]
    assert lines[1].split() == ["world1", "Running", "2", "3/3", "1", "0"]
    starts = [line.index(cell) for line, cell in zip(lines, ["EPOCH", "2", "10"], strict=True)]
    assert len(set(starts)) == 1


def test_a_break_heard_while_the_run_stops_its_processes_is_no_error() -> None:
    """A member stopped before its peers breaks their worlds as the run ends (a store's host
    gone): what they report then is the run's own doing, not an error of the world."""
    pods = PodProcesses(
        MemberLauncher("run", {}, Path(), Path(), {}), LiveView("run", io.StringIO(), live=False), lambda: None
    )
    pods.on_report(BrokenWorldReport(world="world1", epoch=2, reason="rank 0 sent no heartbeat", pod="w1-0"))
    asyncio.run(pods.stop(0.0))
    pods.on_report(BrokenWorldReport(world="world2", epoch=1, reason="store reset", pod="w2-0"))
    assert (pods.breaks_of("world1"), pods.breaks_of("world2")) == ({2: 1}, {})
