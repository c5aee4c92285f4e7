"""Fixtures of the worker tests (helpers in worker_support.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from worker_support import Member, TableServer


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


@pytest.fixture
def table_server() -> Iterator[TableServer]:
    server = TableServer()
    yield server
    server.close()
