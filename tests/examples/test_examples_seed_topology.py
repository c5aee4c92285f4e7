"""Every MultiWorld example in the seed's five-process topology, over gloo (and NCCL where CUDA
is): each process prints
the seed's lines with the values the operation must produce, and every process exits 0."""

from __future__ import annotations

import pytest
from tests.support.examples_expected import (
    EXPECTED,
    WORLD_SIZE,
    all_reduce_lines,
    assert_never_broke,
    check_steps,
    world_tensors,
)
from tests.support.examples_harness import (
    BACKENDS,
    SEED_TOPOLOGY,
    assert_all_exit_zero,
    free_base_port,
    seed_table,
    start_from_table,
    start_seed_topology,
)

STEPS = 3
FAST = ["--steps", str(STEPS), "--interval", "0.05"]


def test_ranks_hold_different_tensors_at_every_step() -> None:
    """Without this, a collective that moved the wrong tensor could still print the right line."""
    for world in ("world1", "world2"):
        for step in range(1, STEPS + 1):
            held = [tuple(t.tolist()) for t in world_tensors(world, step)]
            assert len(set(held)) == WORLD_SIZE, (world, step, held)
            assert held != [tuple(t.tolist()) for t in world_tensors(world, step + 1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_example_prints_the_operation_results(example: str, backend: str) -> None:
    processes = start_seed_topology(example, ["--port", str(free_base_port()), *FAST], backend)
    assert_all_exit_zero(processes)
    for name, process in processes.items():
        check_steps(process, SEED_TOPOLOGY[name], EXPECTED[example], range(1, STEPS + 1))
        assert_never_broke(process)


def test_worlds_from_the_contract_environment() -> None:
    """No --worldinfo: the worlds come from MULTIWORLD_POD / MULTIWORLD_WORLDS (no live table)."""
    table = seed_table(free_base_port())
    processes = start_from_table("all_reduce", table, FAST)
    assert_all_exit_zero(processes)
    for name, process in processes.items():
        check_steps(process, SEED_TOPOLOGY[name], all_reduce_lines, range(1, STEPS + 1))
        assert_never_broke(process)
