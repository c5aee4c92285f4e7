"""Which GPU each local member process gets (a pure function of its place among the processes
in NCCL worlds and the GPU count)."""

from __future__ import annotations

import pytest

from multiworld_operator.local.gpus import gpu_env

pytestmark = pytest.mark.quick


def test_one_gpu_per_process_when_there_are_enough() -> None:
    envs = [gpu_env(f"p{i}", i, gpu_pods=4, devices=8) for i in range(4)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert all("NCCL_HOSTID" not in e for e in envs)


def test_shared_gpus_go_round_robin_and_each_process_is_its_own_nccl_host() -> None:
    envs = [gpu_env(f"p{i}", i, gpu_pods=5, devices=2) for i in range(5)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1", "0"]
    assert len({e["NCCL_HOSTID"] for e in envs}) == 5
    assert {e["NCCL_SOCKET_IFNAME"] for e in envs} == {"lo"}
