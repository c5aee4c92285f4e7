"""What each example must print: the lines of rank `rank` of `world` at `step`, computed from
the examples' deterministic tensors with plain torch."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from tests.support.examples_harness import ExampleProcess, load_common

common = load_common()

WORLD_SIZE = 3
ROOT = 0
BROKE = re.compile(r"world\d+ broke: ")
# NCCL ranks print their tensors with the GPU they live on; the values are what is checked.
CUDA_DEVICE = re.compile(r", device='cuda:\d+'")


def tensor(world: str, rank: int, step: int) -> torch.Tensor:
    return common.example_tensor(world, rank, step, torch.device("cpu"))


def world_tensors(world: str, step: int) -> list[torch.Tensor]:
    return [tensor(world, rank, step) for rank in range(WORLD_SIZE)]


def world_sum(world: str, step: int) -> torch.Tensor:
    return torch.stack(world_tensors(world, step)).sum(dim=0)


# What rank `rank` of `world` must print at `step`, per example.
def all_gather_lines(world: str, rank: int, step: int) -> list[str]:
    return [
        f"rank: {rank} has tensor: {tensor(world, rank, step)}",
        f"rank: {rank} from {world} has gathered tensors: {world_tensors(world, step)}",
    ]


def all_reduce_lines(world: str, rank: int, step: int) -> list[str]:
    return [
        f"rank: {rank} has tensor: {tensor(world, rank, step)}",
        f"rank: {rank} from {world} has reduced tensor: {world_sum(world, step)}",
    ]


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
        return [
            f"rank: {rank} from {world} received tensor: {tensor(world, peer, step)} from rank {peer}"
            for peer in range(1, WORLD_SIZE)
        ]
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


def check_steps(
    process: ExampleProcess, worlds: list[tuple[int, int]], expected: Callable[[str, int, int], list[str]], steps: range
) -> None:
    """`process`, rank R of world W for each (W, R) in `worlds`, printed the expected lines of
    every step in `steps`, and one "done" line per world and step."""
    lines = [CUDA_DEVICE.sub("", line) for line in process.lines]
    for index, rank in worlds:
        for step in steps:
            for line in expected(f"world{index}", rank, step):
                assert line in lines, f"{process.name} is missing {line!r}:\n{process.output()}"
    for step in steps:
        assert lines.count(f"done with step: {step}") == len(worlds), process.output()


def assert_never_broke(process: ExampleProcess) -> None:
    assert not [line for line in process.lines if BROKE.match(line)], process.output()
