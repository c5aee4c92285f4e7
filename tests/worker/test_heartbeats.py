"""Heartbeats: switched off, their requests as worlds grow in ranks and in number, a frozen
process seen in every world it shares, and no verdict on saturated cores.

In-process cases put every member of a world in this one process: a WorldManager each, so a
failure detector each, as separate processes would have (gloo over loopback). A frozen peer
needs real member processes."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

import multiworld as mw
from tests.support.cpu_load import BusyProcesses
from tests.support.worker_support import TEST_DETECT, assignment, free_ports, static_env

QUIET = mw.DetectConfig(heartbeat=False, join_timeout=30, op_timeout=30)
BEATING = mw.DetectConfig(heartbeat_interval=0.05, dead_after=5.0, join_timeout=30, op_timeout=30)
# Saturated cores: busy processes, two per core, for this long with no fault.
BUSY_PROCESSES = 4
SATURATED_S = 30.0
# A frozen peer is still judged dead on saturated cores within this many dead_afters: generous,
# since the judges themselves run late there (bench/failover.py --load times it).
JUDGED_WITHIN_DEAD_AFTERS = 3.0


def join_everywhere(managers: list[mw.WorldManager], worlds: list[str], ports: list[int]) -> list[dict[str, mw.World]]:
    """Every manager joins every world, as rank = its index (rank 0 hosts each world's store)."""
    joined: list[dict[str, mw.World]] = [{} for _ in managers]

    def join(rank: int) -> None:
        assignments = [
            mw.WorldAssignment(name=w, rank=rank, size=len(managers), host="127.0.0.1", port=p)
            for w, p in zip(worlds, ports, strict=True)
        ]
        joined[rank] = managers[rank].join_all(assignments)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(len(managers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(set(j) == set(worlds) for j in joined), joined
    return joined


def heartbeat_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("mw-detector", "mw-beat"))]


def test_a_world_joined_without_heartbeat_runs_none_and_still_breaks_on_an_op_error() -> None:
    (port,) = free_ports(1)
    managers = [mw.WorldManager(pod=f"p{rank}", config=QUIET) for rank in range(2)]
    try:
        w0, w1 = (j["w"] for j in join_everywhere(managers, ["w"], [port]))
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


def per_tick(ranks: int, worlds: int) -> tuple[float, float]:
    """Beat-store calls and keys that one tick of every member costs, for `worlds` worlds of
    `ranks` ranks shared by the same processes (host ticks and link ticks are counted apart,
    since the threads tick independently)."""
    ports = free_ports(worlds)
    managers = [mw.WorldManager(pod=f"p{rank}", config=BEATING) for rank in range(ranks)]
    try:
        join_everywhere(managers, [f"w{i}" for i in range(worlds)], ports)
        time.sleep(0.5)  # past the first ticks, which make the keys
        before = [m.heartbeat_load() for m in managers]
        time.sleep(1.0)
        after = [m.heartbeat_load() for m in managers]
    finally:
        for manager in managers:
            manager.close()
    host_ticks = after[0].host_ticks - before[0].host_ticks
    calls = (after[0].beat_stores.calls - before[0].beat_stores.calls) / host_ticks
    keys = (after[0].beat_stores.keys - before[0].beat_stores.keys) / host_ticks
    for b, a in zip(before[1:], after[1:], strict=True):
        link_ticks = a.link_ticks - b.link_ticks
        calls += (a.beat_stores.calls - b.beat_stores.calls) / link_ticks
        keys += (a.beat_stores.keys - b.beat_stores.keys) / link_ticks
    # A world's own store is asked far less than once a tick.
    assert after[0].world_stores.calls < after[0].host_ticks / 10, after[0]
    return calls, keys


def close(a: float, b: float) -> bool:
    """Equal but for a rare request outside the steady beat (a verdict's news, a confirmation
    read): a reading of the counters holds whole ticks only."""
    return abs(a - b) < 0.3


def test_heartbeat_requests_grow_linearly_with_ranks_and_not_with_shared_worlds() -> None:
    calls, keys = zip(*(per_tick(ranks, 1) for ranks in (2, 3, 4)), strict=True)
    # One more rank adds the same number of calls and of keys, whatever the size.
    for counts in (calls, keys):
        assert counts[1] - counts[0] > 0.5 and close(counts[2] - counts[1], counts[1] - counts[0]), counts
    # Two processes sharing three worlds cost what they cost sharing one.
    shared = per_tick(2, 3)
    assert close(shared[0], calls[0]) and close(shared[1], keys[0]), (shared, calls[0], keys[0])


def test_a_frozen_process_is_seen_in_every_world_it_shares(spawn) -> None:
    """L and P share three idle worlds: L hosts w1 and w2, P hosts w3. P is SIGSTOPped: L sees
    all three break, w1 and w2 because P's heartbeat stopped, w3 because its store host froze."""
    p1, p2, p3 = free_ports(3)
    args = {"detect": TEST_DETECT, "worlds": {"w1": "idle", "w2": "idle", "w3": "idle"}}
    # world: (L's rank, its port); P holds the other rank of each.
    ranks = {"w1": (0, p1), "w2": (0, p2), "w3": (1, p3)}
    leader = spawn("steady", args, static_env("L", [assignment(w, r, 2, port) for w, (r, port) in ranks.items()]))
    peer = spawn("steady", args, static_env("P", [assignment(w, 1 - r, 2, port) for w, (r, port) in ranks.items()]))
    leader.wait_for("joined")
    peer.wait_for("joined")
    peer.signal(signal.SIGSTOP)
    broken = {name: leader.wait_for("broken", world=name) for name in ("w1", "w2", "w3")}
    for name in ("w1", "w2"):
        assert "rank 1 sent no heartbeat" in broken[name]["reason"] and broken[name]["peer_rank"] == 1, broken
    assert "store host did not answer" in broken["w3"]["reason"] and broken["w3"]["peer_rank"] == 0, broken
    leader.tell("stop")
    assert leader.wait_exit() == 0, leader.stderr()
    peer.kill()


def test_a_members_verdict_reaches_the_host_and_the_other_members() -> None:
    """Rank 2 of three leaves: its verdict goes through rank 0's beat store to ranks 0 and 1,
    who learn that it left (no failure), not just that its connections closed."""
    (port,) = free_ports(1)
    managers = [mw.WorldManager(pod=f"p{rank}", config=BEATING) for rank in range(3)]
    try:
        worlds = [j["w"] for j in join_everywhere(managers, ["w"], [port])]
        managers[2].leave("w")
        deadline = time.monotonic() + 60
        while not (worlds[0].broken and worlds[1].broken) and time.monotonic() < deadline:
            time.sleep(0.01)
        for world in worlds[:2]:
            assert world.error is not None and world.error.reason == "rank 2 left the world (verdict of rank 2)", world
        assert all(m.status().errors == {} for m in managers)
    finally:
        for manager in managers:
            manager.close()


def steps_of(member, world: str) -> int:
    return max((e["steps"] for e in member.named("progress") if e["world"] == world), default=0)


def test_saturated_cores_give_no_verdict_and_a_frozen_peer_is_still_judged_dead(spawn) -> None:
    """A and B share a busy world (A hosts it) and an idle one (B hosts it), with the shipped
    detection settings. Once both have joined (new connections to a store can stall it: see
    bench/failover.py), busy processes saturate the cores for SATURATED_S: neither sees a
    verdict. Then B is SIGSTOPped under the same load: A judges it dead in both worlds, by its
    heartbeat in the world A hosts and by the stall of its store in the other, within
    JUDGED_WITHIN_DEAD_AFTERS x dead_after."""
    dead_after = mw.DetectConfig().dead_after
    p1, p2 = free_ports(2)
    args = {"worlds": {"w1": "busy", "w2": "idle"}}
    a = spawn("steady", args, static_env("A", [assignment("w1", 0, 2, p1), assignment("w2", 1, 2, p2)]))
    b = spawn("steady", args, static_env("B", [assignment("w1", 1, 2, p1), assignment("w2", 0, 2, p2)]))
    a.wait_for("joined")
    b.wait_for("joined")
    with BusyProcesses(BUSY_PROCESSES) as busy:
        before = steps_of(a, "w1")
        time.sleep(SATURATED_S)
        print(f"\n{BUSY_PROCESSES} busy processes took {busy.cores():.2f} cores for {SATURATED_S:.0f} s")
        assert not a.named("broken") and not b.named("broken"), (a.named("broken"), b.named("broken"))
        assert steps_of(a, "w1") > before, "w1 made no progress on saturated cores"
        frozen_at = time.time()
        b.signal(signal.SIGSTOP)
        broken = {name: a.wait_for("broken", world=name) for name in ("w1", "w2")}
    for name, event in broken.items():
        took = event["at"] - frozen_at
        print(f"{name}: B judged dead after {took * 1000:.0f} ms on saturated cores ({event['reason']})")
        assert took < JUDGED_WITHIN_DEAD_AFTERS * dead_after, (name, took, event)
        assert event["peer_rank"] == (1 if name == "w1" else 0), event
    assert "rank 1 sent no heartbeat" in broken["w1"]["reason"], broken
    assert "store host did not answer" in broken["w2"]["reason"], broken
    a.tell("stop")
    assert a.wait_exit() == 0, a.stderr()
    b.kill()
