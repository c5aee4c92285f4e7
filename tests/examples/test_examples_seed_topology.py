"""Every MultiWorld example in the seed's five-process topology, over gloo: each process prints
the seed's lines with the values the operation must produce, and every process exits 0."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from multiworld.contract import WorkerEnv, WorldAssignment

from examples_harness import (
    SEED_TOPOLOGY,
    ExampleProcess,
    example_script,
    free_base_port,
    load_common,
    finish,
    start_seed_topology,
)

common = load_common()

STEPS = 3
WORLD_SIZE = 3
ROOT = 0
BROKE = re.compile(r"world\d+ broke: ")


def tensor(world: str, rank: int, step: int) -> torch.Tensor:
    return common.example_tensor(world, rank, step, torch.device("cpu"))


def world_tensors(world: str, step: int) -> list[torch.Tensor]:
    return [tensor(world, rank, step) for rank in range(WORLD_SIZE)]


def world_sum(world: str, step: int) -> torch.Tensor:
    return torch.stack(world_tensors(world, step)).sum(dim=0)


# What rank `rank` of `world` must print at `step`, per example.
def all_gather_lines(world: str, rank: int, step: int) -> list[str]:
    return [f"rank: {rank} has tensor: {tensor(world, rank, step)}",
            f"rank: {rank} from {world} has gathered tensors: {world_tensors(world, step)}"]


def all_reduce_lines(world: str, rank: int, step: int) -> list[str]:
    return [f"rank: {rank} has tensor: {tensor(world, rank, step)}",
            f"rank: {rank} from {world} has reduced tensor: {world_sum(world, step)}"]


def reduce_lines(world: str, rank: int, step: int) -> list[str]:
    lines = [f"rank: {rank} has tensor to be reduced: {tensor(world, rank, step)}"]
    if rank == ROOT:
        lines.append(f"rank: {rank} from {world} has reduced tensor: {world_sum(world, step)}")
    return lines


def broadcast_lines(world: str, rank: int, step: int) -> list[str]:
    if rank == ROOT:
        return [f"rank: {rank} has tensor to be broadcast: {tensor(world, ROOT, step)}"]
    return [f"rank: {rank} from {world} receives tensor: {tensor(world, ROOT, step)}"]


def gather_lines(world: str, rank: int, step: int) -> list[str]:
    lines = [f"rank: {rank} has tensor: {tensor(world, rank, step)}"]
    if rank == ROOT:
        lines.append(f"rank: {rank} from {world} has gathered tensors: {world_tensors(world, step)}")
    return lines


def scatter_lines(world: str, rank: int, step: int) -> list[str]:
    if rank == ROOT:
        return [f"rank: {rank} from {world} scatters tensors: {world_tensors(world, step)}"]
    return [f"rank: {rank} from {world} has tensor: {tensor(world, rank, step)}"]


def send_recv_lines(world: str, rank: int, step: int) -> list[str]:
    if rank == ROOT:
        return [f"rank: {rank} from {world} received tensor: {tensor(world, peer, step)} from rank {peer}"
                for peer in range(1, WORLD_SIZE)]
    return [f"rank: {rank} from {world} sent tensor: {tensor(world, rank, step)}"]


EXPECTED: dict[str, Callable[[str, int, int], list[str]]] = {
    "all_gather": all_gather_lines,
    "all_reduce": all_reduce_lines,
    "reduce": reduce_lines,
    "broadcast": broadcast_lines,
    "gather": gather_lines,
    "scatter": scatter_lines,
    "send_recv": send_recv_lines,
}


def test_ranks_hold_different_tensors_at_every_step() -> None:
    """Without this, a collective that moved the wrong tensor could still print the right line."""
    for world in ("world1", "world2"):
        for step in range(1, STEPS + 1):
            held = [tuple(t.tolist()) for t in world_tensors(world, step)]
            assert len(set(held)) == WORLD_SIZE, (world, step, held)
            assert held != [tuple(t.tolist()) for t in world_tensors(world, step + 1)]


def check_process(name: str, process: ExampleProcess, worlds: list[tuple[int, int]],
                  expected: Callable[[str, int, int], list[str]]) -> None:
    lines = process.lines
    for index, rank in worlds:
        for step in range(1, STEPS + 1):
            for line in expected(f"world{index}", rank, step):
                assert line in lines, f"{name} is missing {line!r}:\n{process.output()}"
    for step in range(1, STEPS + 1):
        # One "done" line per world per step: every world ran every step.
        assert lines.count(f"done with step: {step}") == len(worlds), process.output()
    assert not [line for line in lines if BROKE.match(line)], process.output()


def run_seed_topology(example: str) -> dict[str, ExampleProcess]:
    flags = ["--backend", "gloo", "--port", str(free_base_port()), "--steps", str(STEPS), "--interval", "0.05"]
    processes = start_seed_topology(example, flags)
    assert_all_exit_zero(processes)
    return processes


def assert_all_exit_zero(processes: dict[str, ExampleProcess]) -> None:
    codes = finish(processes)
    assert codes == {name: 0 for name in processes}, {n: p.output() for n, p in processes.items()}


@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_example_prints_the_operation_results(example: str) -> None:
    processes = run_seed_topology(example)
    for name, process in processes.items():
        check_process(name, process, SEED_TOPOLOGY[name], EXPECTED[example])


def test_worlds_from_the_contract_environment() -> None:
    """No --worldinfo: the worlds come from MULTIWORLD_POD / MULTIWORLD_WORLDS (no live table)."""
    base = free_base_port()
    argv = [example_script("all_reduce"), "--steps", str(STEPS), "--interval", "0.05"]
    processes = {}
    for name, worlds in SEED_TOPOLOGY.items():
        env = WorkerEnv(pod=name, table="", worlds=[
            WorldAssignment(name=f"world{index}", rank=rank, size=WORLD_SIZE, host="127.0.0.1",
                            port=base + index, backend="gloo")
            for index, rank in worlds
        ])
        processes[name] = ExampleProcess(name, argv, env.to_env())
    assert_all_exit_zero(processes)
    for name, process in processes.items():
        check_process(name, process, SEED_TOPOLOGY[name], all_reduce_lines)
