"""What a dead process costs. MultiWorld (the seed's all_gather failure case, and the same
kill in every other example): only its world. Plain torch.distributed (single_world): everyone."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
from tests.support.examples_expected import CUDA_DEVICE, EXPECTED
from tests.support.examples_harness import (
    BACKENDS,
    EXIT_TIMEOUT,
    ExampleProcess,
    example_script,
    finish,
    free_base_port,
    load_common,
    start_seed_topology,
)

STEPS = 10
KILL_AFTER_STEP = 3


def broke_lines(process: ExampleProcess, world: str) -> list[str]:
    return [line for line in process.lines if line.startswith(f"{world} broke: ")]


def kill_world1_rank2(example: str, backend: str) -> dict[str, ExampleProcess]:
    """The seed topology, flags from --worldinfo; world1's rank 2 is SIGKILLed after its step
    KILL_AFTER_STEP; returns once every process exited."""
    flags = ["--port", str(free_base_port()), "--steps", str(STEPS), "--interval", "0.2"]
    processes = start_seed_topology(example, flags, backend)
    victim = processes["w1-1"]  # world1, rank 2
    try:
        victim.wait_for_line(f"done with step: {KILL_AFTER_STEP}")
        victim.kill()
    finally:
        finish(processes)
    return processes


@pytest.mark.parametrize("example", sorted(set(EXPECTED) - {"all_gather"}))
def test_every_example_loses_only_the_world_of_a_dead_rank(example: str) -> None:
    processes = kill_world1_rank2(example, "gloo")
    leader = processes["leader"]
    lines = [CUDA_DEVICE.sub("", line) for line in leader.lines]
    assert leader.proc.returncode == 0, leader.output()
    assert len(broke_lines(leader, "world1")) == 1 and not broke_lines(leader, "world2"), leader.output()
    for step in range(1, STEPS + 1):
        for line in EXPECTED[example]("world2", 0, step):
            assert line in lines, f"leader is missing {line!r}:\n{leader.output()}"
    assert lines.count("done with step: 1") == 2 and lines.count(f"done with step: {STEPS}") == 1, leader.output()
    assert processes["w1-0"].proc.returncode == 1, processes["w1-0"].output()
    for name in ("w2-0", "w2-1"):
        assert processes[name].proc.returncode == 0, processes[name].output()
        assert not [line for line in processes[name].lines if "broke" in line], processes[name].output()


@pytest.mark.parametrize("backend", BACKENDS)
def test_killing_a_world1_rank_leaves_world2_untouched(backend: str) -> None:
    processes = kill_world1_rank2("all_gather", backend)
    codes = {name: process.proc.returncode for name, process in processes.items()}
    outputs = {name: process.output() for name, process in processes.items()}

    leader = processes["leader"]
    # The leader finished every world2 step, said once that world1 broke, and exited 0.
    assert codes["leader"] == 0, outputs
    assert len(broke_lines(leader, "world1")) == 1, outputs["leader"]
    assert not broke_lines(leader, "world2"), outputs["leader"]
    world2_done = [line for line in leader.lines if line.startswith("rank: 0 from world2 has gathered")]
    assert len(world2_done) == STEPS, outputs["leader"]
    assert f"done with step: {STEPS}" in leader.lines, outputs["leader"]
    world1_done = [line for line in leader.lines if line.startswith("rank: 0 from world1 has gathered")]
    assert KILL_AFTER_STEP <= len(world1_done) < STEPS, outputs["leader"]

    # world1's surviving rank saw the break and stopped, with the status of a process whose
    # every world broke.
    survivor = processes["w1-0"]
    assert len(broke_lines(survivor, "world1")) == 1, outputs["w1-0"]
    assert codes["w1-0"] == 1, outputs["w1-0"]
    assert f"done with step: {STEPS}" not in survivor.lines, outputs["w1-0"]

    # world2's ranks never noticed.
    for name in ("w2-0", "w2-1"):
        assert codes[name] == 0, outputs[name]
        assert f"done with step: {STEPS}" in processes[name].lines, outputs[name]
        assert not [line for line in processes[name].lines if "broke" in line], outputs[name]


def test_single_world_without_a_death_every_rank_finishes() -> None:
    common = load_common()
    steps = 2
    argv = [example_script("single_world"), "--backend", "gloo", "--worldsize", "3",
            "--port", str(free_base_port(0)), "--steps", str(steps), "--interval", "0.05"]  # fmt: skip
    parent = ExampleProcess("single_world", argv)
    assert parent.wait() == 0, parent.output()
    for step in range(1, steps + 1):
        for rank in (1, 2):
            sent = common.example_tensor("world", rank, step, common.torch.device("cpu"))
            assert f"rank: {rank} sent tensor: {sent}" in parent.lines, parent.output()
            assert f"rank: 0 received tensor: {sent} from rank {rank}" in parent.lines, parent.output()
    assert parent.lines.count(f"done with step: {steps}") == 3, parent.output()
    assert "exit codes by rank: [0, 0, 0]" in parent.lines, parent.output()


def test_single_world_one_death_takes_everyone_down() -> None:
    argv = [example_script("single_world"), "--backend", "gloo", "--worldsize", "3",
            "--port", str(free_base_port(0)), "--steps", "1000", "--interval", "0.1", "--timeout", "20"]  # fmt: skip
    parent = ExampleProcess("single_world", argv)
    pids: dict[int, int] = {}
    try:
        parent.wait_for_line(f"done with step: {KILL_AFTER_STEP}")
        for line in parent.lines:
            if match := re.fullmatch(r"rank: (\d+) runs as pid (\d+)", line):
                pids[int(match.group(1))] = int(match.group(2))
        assert sorted(pids) == [0, 1, 2], parent.output()
        os.kill(pids[2], signal.SIGKILL)
        code = parent.wait(EXIT_TIMEOUT)
    finally:
        for pid in [parent.proc.pid, *pids.values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.proc.wait()
    # The survivors did not carry on without rank 2: each lost the world and exited non-zero.
    assert code != 0, parent.output()
    for rank in (0, 1):
        assert any(line.startswith(f"rank: {rank} lost the world: ") for line in parent.lines), parent.output()
    assert "done with step: 1000" not in parent.lines, parent.output()
    codes_line = next(line for line in parent.lines if line.startswith("exit codes by rank: "))
    assert all(code != 0 for code in json.loads(codes_line.removeprefix("exit codes by rank: "))), codes_line
