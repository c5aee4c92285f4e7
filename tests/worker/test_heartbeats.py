"""The heartbeat: switched off, and (below) how it scales with ranks and worlds.

Both members of a world in this one process where that suffices (two managers, gloo over
loopback); real member processes where a peer must freeze."""

from __future__ import annotations

import threading

import pytest
import torch

import multiworld as mw
from worker_support import free_ports

QUIET = mw.DetectConfig(heartbeat=False, join_timeout=30, op_timeout=30)


def join_pair(configs: list[mw.DetectConfig], port: int) -> tuple[list[mw.WorldManager], list[mw.World]]:
    managers = [mw.WorldManager(pod=f"p{rank}", config=config) for rank, config in enumerate(configs)]
    worlds: list[mw.World | None] = [None, None]

    def join(rank: int) -> None:
        a = mw.WorldAssignment(name="w", rank=rank, size=2, host="127.0.0.1", port=port, epoch=1)
        worlds[rank] = managers[rank].join(a)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(w is not None for w in worlds)
    return managers, worlds  # type: ignore[return-value]


def heartbeat_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("mw-heartbeat")]


def test_a_world_joined_without_heartbeat_runs_none_and_still_breaks_on_an_op_error() -> None:
    (port,) = free_ports(1)
    managers, (w0, w1) = join_pair([QUIET, QUIET], port)
    try:
        assert heartbeat_threads() == []
        t = torch.ones(2)
        w0_done = threading.Thread(target=w0.all_reduce, args=(t,))
        w0_done.start()
        w1.all_reduce(torch.ones(2))
        w0_done.join()
        assert t.tolist() == [2.0, 2.0]
        managers[1].close()
        with pytest.raises(mw.WorldBrokenError):
            w0.all_reduce(torch.ones(2))
        assert w0.broken
    finally:
        for manager in managers:
            manager.close()
