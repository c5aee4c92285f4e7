"""Programs written for pymultiworld run unchanged (pymultiworld_program.py: asyncio, one task
per world, `--worldinfo`): five processes, gloo over loopback, the seed's topology (a leader
in world1 and world2, two workers in each).

Every program is bounded by generous waits only. The op timeout is set far beyond them, so a
program that waited out an op on a dead or frozen peer (instead of seeing the error, or ending
at cleanup()) fails the test.
"""

from __future__ import annotations

import asyncio
import pickle
import signal
import sys
import time
from typing import Any

import pytest
import torch

import multiworld
from multiworld.communicator import BrokenWorldException
from multiworld.contract import WORLD_NAME_RE
from multiworld.errors import UnknownWorldError, WorldBrokenError
from multiworld.manager import WorldManager
from multiworld.pymultiworld.world_labels import world_label
from tests.support.worker_support import TEST_DETECT, free_ports

# Run as a module from the repository root (the members' working directory): it imports member.py's helpers.
PROGRAM = ["-m", "tests.worker.pymultiworld_program"]
SIZE = 3
LENGTH = 3
ENV = {"MULTIWORLD_DEAD_AFTER": str(TEST_DETECT["dead_after"]), "MULTIWORLD_OP_TIMEOUT": "600"}


def launch(spawn, worldinfo: list[str], ports: list[int], *flags: str, names: dict[int, str] | None = None):
    argv = [*PROGRAM, "--timeout", "60"]
    for info in worldinfo:
        argv += ["--worldinfo", info]
    for index, port in enumerate(ports, start=1):
        argv += ["--port", f"{index},{port}"]
    for index, name in (names or {}).items():
        argv += ["--name", f"{index},{name}"]
    return spawn(f"program {' '.join(worldinfo)}", {}, ENV, [*argv, *flags])


def seed_topology(spawn, ports: list[int], *flags: str, names: dict[int, str] | None = None) -> dict[str, Any]:
    """The leader (rank 0 of world1 and world2), then ranks 1 and 2 of each world."""
    members = {"leader": launch(spawn, ["1,0", "2,0"], ports, *flags, names=names)}
    for index in (1, 2):
        for rank in (1, 2):
            members[f"{index},{rank}"] = launch(spawn, [f"{index},{rank}"], ports, *flags, names=names)
    return members


def steps(member, world: int) -> list[dict[str, Any]]:
    return [e for e in member.named("step") if e["world"] == world]


def ended_by_cleanup(member) -> None:
    """The program reached cleanup(), which ended it with status 0 and ran nothing after it."""
    assert member.wait_exit() == 0, member.stderr()
    assert member.named("cleanup"), member.stderr()
    assert not member.named("after_cleanup")


# ---- in one process: names, arguments, errors --------------------------------------------


def test_one_manager_class_serves_both_apis_and_names_map_to_labels() -> None:
    assert WorldManager is multiworld.WorldManager
    assert WorldManager(enable_monitor=False).config.heartbeat is False
    assert WorldManager().config.heartbeat is True
    assert world_label("world1") == "world1"
    names = ["", "World 1", "world_1", "world.1", "a" * 64, "ä", "-x-", "world1 "]
    labels = [world_label(name) for name in names]
    assert all(WORLD_NAME_RE.match(label) and len(label) <= 63 for label in labels), labels
    assert len(set(labels)) == len(names)
    assert labels == [world_label(name) for name in names]

    error = BrokenWorldException("world 1", "peer gone", 2, 1)
    assert str(error) == "world 1 broken: peer gone"
    assert isinstance(error, WorldBrokenError) and error.epoch == 2 and error.peer_rank == 1
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


# call -> (error type, words its message must hold)
BAD_CALLS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "port -1": (dict(port=-1), ValueError, "port"),
    "rank out of world": (dict(rank=3), ValueError, "rank 3 is out of range for world_size 3"),
    "world of one": (dict(rank=0, world_size=1), ValueError, "world_size"),
    "unknown backend": (dict(backend="mpi"), ValueError, "backend"),
    "name not a str": (dict(world_name=1), ValueError, "world_name"),
    "no address": (dict(addr=""), ValueError, "addr"),
    "no time": (dict(timeout=0), ValueError, "timeout"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_initialize_world_refuses_bad_arguments_naming_them(case: str) -> None:
    changes, error, words = BAD_CALLS[case]
    call: dict[str, Any] = dict(world_name="w", rank=1, world_size=SIZE, port=free_ports(1)[0]) | changes

    async def initialize() -> None:
        with WorldManager() as manager:
            await manager.initialize_world(**call)

    with pytest.raises(error, match=words):
        asyncio.run(initialize())


def test_unknown_world_names_are_refused_naming_them() -> None:
    with pytest.raises(TypeError, match="enable_monitor is a keyword"):
        WorldManager(False)  # type: ignore[arg-type]  # a positional argument on purpose: the refusal is tested
    with WorldManager() as manager:
        with pytest.raises(UnknownWorldError, match="unknown world 'nowhere'"):
            # No tensor: the unknown world is refused before the tensor is looked at.
            asyncio.run(manager.communicator.all_reduce(None, world_name="nowhere"))  # type: ignore[arg-type]  # see above
        with pytest.raises(ValueError, match="unknown world 'nowhere'"):
            manager.remove_world("nowhere")
        assert manager.communicator.is_broken("nowhere")


def test_a_removed_world_is_initialized_again_under_its_name() -> None:
    """Both members in this process (two managers), in the default world "": rank 0 removes
    it, rank 1's next op raises BrokenWorldException, and both initialize it again (rank 0 at
    once, while its store would still be winding down) at the next epoch."""
    port = free_ports(1)[0]

    async def run() -> list[float]:
        with WorldManager() as host, WorldManager() as peer:
            managers = (host, peer)

            async def initialize() -> None:
                await asyncio.gather(
                    *(m.initialize_world("", rank, 2, port=port, timeout=30) for rank, m in enumerate(managers))
                )

            async def all_reduce() -> list[float]:
                tensors = [torch.ones(2) for _ in managers]
                await asyncio.gather(*(m.communicator.all_reduce(t) for m, t in zip(managers, tensors, strict=True)))
                return tensors[1].tolist()

            await initialize()
            assert await all_reduce() == [2.0, 2.0]
            with pytest.raises(ValueError, match="initialized already"):
                await host.initialize_world("", 0, 2, port=port)
            host.remove_world("")
            host.remove_world("")  # as in pymultiworld, removing a removed world is no error
            assert host.communicator.is_broken()
            with pytest.raises(BrokenWorldException, match="^ broken: removed"):
                await host.communicator.all_reduce(torch.ones(2))
            with pytest.raises(BrokenWorldException, match="^ broken: rank 0 left the world"):
                await peer.communicator.all_reduce(torch.ones(2))
            await initialize()
            assert [m.world(world_label("")).epoch for m in managers] == [2, 2]
            # Past the moment the removed world's store would have stopped (World._stop_serving).
            await asyncio.sleep(host.config.dead_after + 4 * host.config.heartbeat_interval)
            assert not peer.communicator.is_broken("")
            return await all_reduce()

    assert asyncio.run(run()) == [2.0, 2.0]


# ---- five processes --------------------------------------------------------------------


def mine(index: int, rank: int, step: int) -> list[float]:
    base = 100 * index + 10 * rank + step
    return [float(base + k) for k in range(LENGTH)]


def expected(index: int, rank: int, step: int) -> dict[str, list[float]]:
    everyone = [v for r in range(SIZE) for v in mine(index, r, step)]
    total = [sum(mine(index, r, step)[k] for r in range(SIZE)) for k in range(LENGTH)]
    out = {
        "all_reduce": total,
        "all_reduce_max": mine(index, SIZE - 1, step),
        "broadcast": mine(index, 0, step),
        "broadcast_last": mine(index, SIZE - 1, step),
        "all_gather": everyone,
        "scatter": mine(index, rank, step),
    }
    if rank == 0:
        out |= {"reduce": total, "gather": everyone, "recv": everyone[LENGTH:]}
    else:
        out["recv"] = [v + rank for v in mine(index, 0, step)]
    return out


def test_every_op_in_two_worlds_then_cleanup_ends_every_program(spawn) -> None:
    """world1 has a name that is no DNS label; world2 is the default world "" (its ops are
    called without world_name)."""
    names = {1: "World 1/ä", 2: ""}
    members = seed_topology(spawn, free_ports(2), "--op", "all", "--steps", "2", "--interval", "0.05", names=names)
    for who, member in members.items():
        worlds = [1, 2] if who == "leader" else [int(who[0])]
        rank = 0 if who == "leader" else int(who[2])
        for index in worlds:
            member.wait_for("done", world=index)
            done = steps(member, index)
            assert [e["step"] for e in done] == [1, 2], (who, index, member.stderr())
            for event in done:
                assert event["results"] == expected(index, rank, event["step"]), (who, index, event)
        assert not member.named("caught"), (who, member.named("caught"))
        ended_by_cleanup(member)


@pytest.mark.parametrize("monitor", [True, False], ids=["monitor", "no-monitor"])
def test_a_killed_worker_breaks_only_its_world(spawn, monitor: bool) -> None:
    """The seed's experiment: kill rank 1 of world1. Its world's members catch the error in
    their except clause; the leader goes on in world2, whose workers see nothing; every program
    left ends through cleanup(). Without the monitor, op errors alone break the world."""
    flags = ["--op", "all_reduce", "--steps", "40", "--interval", "0.1"] + ([] if monitor else ["--no-monitor"])
    members = seed_topology(spawn, free_ports(2), *flags)
    leader, victim = members["leader"], members["1,1"]
    leader.wait_for("step", world=1, step=3)
    victim.signal(signal.SIGKILL)

    caught = leader.wait_for("caught", world=1)
    assert caught["broken"] and caught["is_broken"], caught
    assert caught["error"].startswith("world1 broken: "), caught
    assert members["1,2"].wait_for("caught", world=1)["broken"]
    leader.wait_for("done", world=2)
    assert [e["step"] for e in steps(leader, 2)] == list(range(1, 41))
    assert any(e["at"] > caught["at"] for e in steps(leader, 2)), "world2 stopped with world1"
    for who in ("leader", "1,2", "2,1", "2,2"):
        member = members[who]
        assert all(e["results"]["all_reduce"] == [3.0] * LENGTH for e in member.named("step")), who
        assert [e["world"] for e in member.named("caught")] == ([] if who[0] == "2" else [1]), who
        ended_by_cleanup(member)


def test_a_broken_worlds_name_is_initialized_again_and_its_replaced_member_is_refused(spawn) -> None:
    """Rank 1 of world1 hangs (SIGSTOP): the heartbeat breaks world1. Its survivors initialize
    world1 again and, with a restarted rank 1, form it at its next epoch, while world2 goes on.
    The hung process, resumed, sees its world broken and cannot join the new one."""
    ports = free_ports(2)
    flags = ["--op", "all_reduce", "--steps", "60", "--interval", "0.1"]
    members = seed_topology(spawn, ports, *flags, "--reinit", "1")
    leader, hung, survivor = members["leader"], members["1,1"], members["1,2"]
    leader.wait_for("step", world=1, step=3)
    stopped_at = time.time()
    hung.signal(signal.SIGSTOP)

    caught = leader.wait_for("caught", world=1)
    assert caught["broken"], caught
    print(f"\nhung peer: world1 broken after {caught['at'] - stopped_at:.2f}s ({caught['error']})", file=sys.stderr)
    survivor.wait_for("caught", world=1)
    restarted = launch(spawn, ["1,1"], ports, *flags)
    reinitialized = leader.wait_for("reinitialized", world=1)
    assert not reinitialized["is_broken"]
    survivor.wait_for("reinitialized", world=1)
    restarted.wait_for("step", world=1, step=2)
    leader.wait_for("step", world=1, step=caught["step"] + 1)

    hung.signal(signal.SIGCONT)
    assert hung.wait_for("caught", world=1)["broken"]
    refused = hung.wait_for("reinit_failed", world=1)
    assert "was replaced" in refused["error"], refused
    ended_by_cleanup(hung)

    # The survivors may end world1 a step apart (the one that ends first leaves it): the
    # leader's steps run on from where they broke off, to its last.
    leader.wait_for("done", world=1)
    world1 = [e["step"] for e in steps(leader, 1)]
    assert world1 == list(range(1, world1[-1] + 1)) and world1[-1] > caught["step"], world1
    assert [e["step"] for e in steps(leader, 2)] == list(range(1, 61))
    assert any(caught["at"] < e["at"] < reinitialized["at"] for e in steps(leader, 2)), "world2 waited for world1"
    for who, member in {**members, "restarted": restarted}.items():
        assert all(e["results"]["all_reduce"] == [3.0] * LENGTH for e in member.named("step")), who
        assert not [e for e in member.named("caught") if e["world"] == 2], who
        ended_by_cleanup(member)
