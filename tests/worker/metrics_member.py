"""A member of the metrics tests (test_worker_metrics.py), started from its environment
(`init_from_env`) in world `w` of two ranks.

It runs 3 all_reduce and 2 broadcast, blocking and async, and one send (rank 0) / recv (rank 1,
async), says `ops_done` with whether prometheus_client is loaded, then holds its world until a
line on stdin.
"""

from __future__ import annotations

import json
import sys

import torch

import multiworld as mw


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    manager = mw.init_from_env()
    world = manager.world("w")
    t = torch.ones(1)
    world.all_reduce(t)
    world.all_reduce(t)
    works = [world.all_reduce(t, async_op=True)]
    world.broadcast(t, src=0)
    works.append(world.broadcast(t, src=0, async_op=True))
    if world.rank == 0:
        world.send(t, dst=1)
    else:
        works.append(world.recv(t, src=0, async_op=True))
    for work in works:
        assert work is not None and work.wait()
    emit("ops_done", rank=world.rank, prometheus_loaded="prometheus_client" in sys.modules)
    sys.stdin.readline()
    manager.close()


if __name__ == "__main__":
    main()
