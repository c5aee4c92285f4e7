"""Fixtures of the worker tests (helpers in tests/support/worker_support.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.worker_support import Member, TableServer

# How much of each member's output a failed test shows.
STDERR_TAIL = 3000
EVENTS_TAIL = 10


@pytest.fixture
def spawn() -> Iterator[Callable[..., Member]]:
    """Start members; every one still alive is killed at the end (SIGKILL also ends SIGSTOPped ones)."""
    started: list[Member] = []

    def start(
        scenario: str, args: dict[str, Any], env: dict[str, str] | None = None, argv: list[str] | None = None
    ) -> Member:
        member = Member(scenario, args, env, argv)
        started.append(member)
        return member

    yield start
    for member in started:
        member.kill()
    # Shown by pytest only when the test failed: what every member said, not only the one that
    # raised (a peer's verdict explains a member's failure).
    for member in started:
        said = [event for event in member.events if event["event"] != "step"][-EVENTS_TAIL:]
        print(f"--- member {member.name}: {said}\n{member.stderr()[-STDERR_TAIL:]}", file=sys.stderr)


@pytest.fixture
def table_server() -> Iterator[TableServer]:
    server = TableServer()
    yield server
    server.close()
