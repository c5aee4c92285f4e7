"""Examples that follow the live world table (no --worldinfo, MULTIWORLD_TABLE=local://...).

The test plays the platform with the local runner's own channel server: it publishes tables,
takes the workers' reports, and starts a replacement process as the runner would.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tests.support.examples_expected import EXPECTED, all_reduce_lines, assert_never_broke, check_steps
from tests.support.examples_harness import (
    EXIT_TIMEOUT,
    SEED_TOPOLOGY,
    ExampleProcess,
    assert_all_exit_zero,
    example_script,
    free_base_port,
    member_env,
    seed_table,
    start_from_table,
    stop_all,
)

from multiworld.contract import BrokenWorldReport, WorldTable
from multiworld_operator.channel_server import ChannelServer, local_url

KILL_AFTER_STEP = 3


class Platform:
    """The local runner's channel server on a loop thread of its own."""

    def __init__(self) -> None:
        self.reports: list[BrokenWorldReport] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = ChannelServer(on_report=lambda _, report: self.reports.append(report), on_status=lambda _, s: None)
        self.url = local_url(asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(10))

    def publish(self, table: WorldTable) -> None:
        self._loop.call_soon_threadsafe(self._server.publish, table)

    def wait_report(self, world: str, epoch: int) -> None:
        deadline = time.monotonic() + EXIT_TIMEOUT
        while not any(r.world == world and r.epoch == epoch for r in self.reports):
            assert time.monotonic() < deadline, f"no report of {world} epoch {epoch}: {self.reports}"
            time.sleep(0.05)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def start_members(example: str, table: WorldTable, platform: Platform, flags: list[str]) -> dict[str, ExampleProcess]:
    platform.publish(table)
    return start_from_table(example, table, flags, platform.url)


@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_a_rebuilt_world_is_taken_up_again_at_its_new_epoch(example: str) -> None:
    steps = 12
    base = free_base_port()
    platform = Platform()
    lines = EXPECTED[example]
    processes = start_members(example, seed_table(base), platform, ["--steps", str(steps), "--interval", "0.25"])
    dead: list[ExampleProcess] = []
    try:
        processes["w1-1"].wait_for_line(f"done with step: {KILL_AFTER_STEP}")
        processes["w1-1"].kill()
        assert processes["w1-1"].wait() != 0
        platform.wait_report("world1", 1)
        # What the platform does next: world1 at epoch 2, a new process for the dead pod.
        rebuilt = seed_table(base, revision=2, epochs={"world1": 2})
        platform.publish(rebuilt)
        dead.append(processes.pop("w1-1"))
        processes["w1-1"] = ExampleProcess(
            "w1-1 (replacement)",
            [example_script(example), "--steps", str(steps), "--interval", "0.25"],
            member_env(rebuilt, "w1-1", platform.url),
        )
        assert_all_exit_zero(processes)
    finally:
        stop_all([*dead, *processes.values()])
        platform.close()
    outputs = {name: process.output() for name, process in processes.items()}

    leader, survivor, replacement = processes["leader"], processes["w1-0"], processes["w1-1"]
    for process in (leader, survivor):
        assert "world1 rejoined at epoch 2" in process.lines, process.output()
        assert len([line for line in process.lines if line.startswith("world1 broke: ")]) == 1, process.output()
    # The step count went on: one "done with step: 1" and one last step per world.
    assert leader.lines.count("done with step: 1") == 2, outputs["leader"]
    assert leader.lines.count(f"done with step: {steps}") == 2, outputs["leader"]
    assert survivor.lines.count("done with step: 1") == 1, outputs["w1-0"]
    # The replacement went on from the survivors' step, with the values of that step.
    assert "done with step: 1" not in replacement.lines, outputs["w1-1"]
    check_steps(replacement, [(1, 2)], lines, range(steps, steps + 1))
    check_steps(survivor, [(1, 1)], lines, range(steps, steps + 1))
    # world2 never noticed.
    assert not [line for line in leader.lines if line.startswith("world2 broke")], outputs["leader"]
    for name in ("w2-0", "w2-1"):
        check_steps(processes[name], SEED_TOPOLOGY[name], lines, range(1, steps + 1))
        assert_never_broke(processes[name])


def test_a_world_removed_from_the_table_ends_its_loop() -> None:
    steps = 40
    base = free_base_port()
    platform = Platform()
    processes = start_members("all_reduce", seed_table(base), platform, ["--steps", str(steps), "--interval", "0.1"])
    try:
        processes["w1-0"].wait_for_line("done with step: 2")
        platform.publish(seed_table(base, revision=2, worlds=["world2"]))
        assert_all_exit_zero(processes)
    finally:
        stop_all(processes.values())
        platform.close()

    ended = "world1 ended: removed from the world table"
    for name in ("leader", "w1-0", "w1-1"):
        assert ended in processes[name].lines, processes[name].output()
        assert not [line for line in processes[name].lines if line.startswith("world1 broke")], processes[name].output()
    assert processes["w1-0"].lines.count(f"done with step: {steps}") == 0, processes["w1-0"].output()
    # The leader finished world2 alone.
    assert processes["leader"].lines.count(f"done with step: {steps}") == 1, processes["leader"].output()
    for name in ("w2-0", "w2-1"):
        check_steps(processes[name], SEED_TOPOLOGY[name], all_reduce_lines, range(1, steps + 1))
        assert_never_broke(processes[name])
