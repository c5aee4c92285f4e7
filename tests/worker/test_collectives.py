"""Every op's result in two worlds at once, in the same four processes: blocking and awaited.

The `tutorial` world is the seed tutorial's 4-rank setup (all_reduce 4.0 everywhere, reduce
4.0 on rank 0, gather/all_gather [0, 1, 2, 3], scatter rank+1, broadcast 0); `mirror` holds
the same processes in reverse rank order, so each process has a different rank in each.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.worker_support import BACKENDS, TEST_DETECT, assignment, free_ports

SIZE = 4
# gloo has all_to_all from torch 2.12; before, the op is refused (UnsupportedOpError) and the
# world goes on.
GLOO_ALL_TO_ALL = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 12)


def expected(rank: int, backend: str) -> dict[str, list[float] | str | None]:
    others = range(SIZE)
    strided = {"all_gather_strided": [x for k in others for x in (float(k), 8.0)]} if backend == "gloo" else {}
    return strided | {
        "all_reduce": [4.0],
        "all_reduce_max": [float(SIZE)] * 2,
        "gather": [0.0, 1.0, 2.0, 3.0] if rank == 0 else None,
        "all_gather": [0.0, 1.0, 2.0, 3.0],
        "scatter": [rank + 1.0],
        "broadcast": [0.0],
        "broadcast_last": [100.0 + SIZE - 1],
        "reduce_scatter": [float(sum(k * 10 + rank for k in others))],
        "all_to_all": [float(k * 10 + rank) for k in others] if backend == "nccl" or GLOO_ALL_TO_ALL else "unsupported",
        "ring": [float((rank - 1) % SIZE)],
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_in_two_worlds_at_once(spawn, backend: str) -> None:
    tutorial_port, mirror_port = free_ports(2)
    members = [
        spawn(
            "collectives",
            {
                "pod": f"p{i}",
                "backend": backend,
                "detect": TEST_DETECT,
                "worlds": [
                    assignment("tutorial", i, SIZE, tutorial_port, backend=backend),
                    assignment("mirror", SIZE - 1 - i, SIZE, mirror_port, backend=backend),
                ],
            },
        )
        for i in range(SIZE)
    ]
    for i, member in enumerate(members):
        event = member.wait_for("results")
        assert event["ranks"] == {"tutorial": i, "mirror": SIZE - 1 - i}
        assert event["status"]["joined"] == {"tutorial": 1, "mirror": 1}
        assert event["status"]["errors"] == {}
        for world, rank in event["ranks"].items():
            for mode in ("blocking", "async"):
                got = event["results"][f"{world}/{mode}"]
                want = expected(rank, backend)
                for op, value in want.items():
                    assert got[op] == value, f"{world} {mode} {op} on rank {rank}: {got[op]} != {value}"
                if rank == 0:
                    assert got["reduce"] == [4.0], f"{world} {mode} reduce on rank 0"
    for member in members:
        member.tell("close")
    for member in members:
        assert member.wait_exit() == 0, member.stderr()
