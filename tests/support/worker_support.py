"""Helpers of the worker tests: real member processes (gloo over loopback, and NCCL where a
CUDA device is) and the local runner's real channel server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from multiworld.contract import BrokenWorldReport, WorkerEnv, WorkerStatus, WorldAssignment, WorldEntry, WorldTable
from multiworld_operator.channel_server import ChannelServer, Speaker, local_url
from multiworld_operator.local.store_ports import free_store_ports
from tests.support import members

REPO = Path(__file__).resolve().parents[2]
MEMBER = REPO / "tests" / "worker" / "member.py"
WAIT = members.WAIT_S
# Tests run on busy machines: a heartbeat a little late must not look like a death.
TEST_DETECT = {"dead_after": 2.0, "join_timeout": 60.0, "op_timeout": 60.0}
# Store ports as `multiworld run` picks them: none that the kernel hands out to other sockets.
free_ports = free_store_ports


# The backends a test runs on: gloo everywhere, NCCL only where CUDA is (member.py gives each
# process its own NCCL host id, so a single GPU serves every rank).
BACKENDS = [
    "gloo",
    pytest.param("nccl", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA device")),
]


def assignment(name: str, rank: int, size: int, port: int, epoch: int = 1, backend: str = "gloo") -> dict[str, Any]:
    return WorldAssignment(
        name=name, rank=rank, size=size, host="127.0.0.1", port=port, epoch=epoch, backend=backend
    ).model_dump()


class Member(members.Member):
    """One member process running a scenario of tests/worker/member.py (or, given `argv`, that
    program of its own, named `scenario` in messages), from the repository root (where `-m
    tests.worker.NAME` finds a program); its stdout is JSON events."""

    def __init__(
        self, scenario: str, args: dict[str, Any], env: dict[str, str] | None = None, argv: list[str] | None = None
    ) -> None:
        self.scenario = scenario
        super().__init__(
            argv if argv is not None else [str(MEMBER), scenario, json.dumps(args)],
            name=scenario,
            env={"PYTHONFAULTHANDLER": "1", **(env or {})},
            cwd=REPO,
            wait_s=WAIT,
        )


class TableServer:
    """The local runner's real channel server, on its own event loop thread."""

    def __init__(self) -> None:
        self.reports: list[BrokenWorldReport] = []
        self.statuses: list[WorkerStatus] = []
        self._cond = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = ChannelServer(on_report=self._record, on_status=self._record)
        self.url = local_url(asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(10))

    def _record(self, _: Speaker, message: BrokenWorldReport | WorkerStatus) -> None:
        with self._cond:
            if isinstance(message, BrokenWorldReport):
                self.reports.append(message)
            else:
                self.statuses.append(message)
            self._cond.notify_all()

    def publish(self, table: WorldTable) -> None:
        self._loop.call_soon_threadsafe(self._server.publish, table)

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{what} within {timeout}s; reports {self.reports}, statuses {self.statuses[-5:]}"
                    )
                self._cond.wait(left)

    def env(self, pod: str, worlds: list[dict[str, Any]]) -> dict[str, str]:
        return WorkerEnv(pod=pod, worlds=worlds, table=self.url).to_env()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def table(revision: int, *entries: tuple[str, int, int, list[str]], backend: str = "gloo") -> WorldTable:
    """entries: (world, epoch, port, pods in rank order)."""
    return WorldTable(
        revision=revision,
        worlds=[
            WorldEntry(name=n, epoch=e, host="127.0.0.1", port=p, pods=pods, backend=backend)
            for n, e, p, pods in entries
        ],
    )


def static_env(pod: str, worlds: list[dict[str, Any]]) -> dict[str, str]:
    return WorkerEnv(pod=pod, worlds=worlds).to_env()
