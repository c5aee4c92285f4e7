"""How a judge measures silence (silence.py): its own pauses do not count, and a stall inside a
reading never does. The clock is the real one: the test sleeps."""

from __future__ import annotations

import time

import pytest

from multiworld.detect.silence import LATE_TICKS, JudgeClock, StillCounter

INTERVAL = 0.05


def test_a_judge_paused_for_many_intervals_credits_its_pause_with_two() -> None:
    clock = JudgeClock(INTERVAL)
    start = clock.now()
    time.sleep(10 * INTERVAL)
    paused = clock.now() - start
    assert paused == pytest.approx(LATE_TICKS * INTERVAL), paused
    assert clock.take_late() == 1 and clock.take_late() == 0
    # Gaps up to the cap count in full: the clock runs as wall time.
    for _ in range(4):
        before = clock.now()
        time.sleep(INTERVAL / 2)
        assert INTERVAL / 2 <= clock.now() - before <= LATE_TICKS * INTERVAL


def test_silence_runs_from_the_return_of_the_first_reading_to_the_sending_of_the_last() -> None:
    counter = StillCounter(0.0)
    assert counter.see(b"1", sent=0.0, returned=0.3) == 0.0  # new value: it moved
    assert counter.see(b"1", sent=0.5, returned=0.9) == pytest.approx(0.5 - 0.3)
    assert counter.see(b"1", sent=1.0, returned=1.0) == pytest.approx(1.0 - 0.3)
    assert counter.see(b"2", sent=1.1, returned=1.2) == 0.0
    assert counter.see(b"2", sent=1.3, returned=1.4) == pytest.approx(1.3 - 1.2)


def test_a_call_found_in_flight_started_at_most_two_intervals_before_on_the_judges_clock() -> None:
    clock = JudgeClock(INTERVAL)
    started = time.monotonic()
    time.sleep(10 * INTERVAL)
    now = clock.now()
    assert now - clock.since_wall(started) == pytest.approx(LATE_TICKS * INTERVAL)
    recent = time.monotonic()
    now = clock.now()
    assert 0.0 <= now - clock.since_wall(recent) < INTERVAL
