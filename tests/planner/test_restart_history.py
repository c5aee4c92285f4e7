"""A world's restart history stays bounded however many restarts its failure policy allows
(issue 21 item 4): the planner keeps the last few restarts in the window one by one and the
older ones counted per slot of the window, and decides as it did from the whole list."""

from __future__ import annotations

from datetime import timedelta

import pytest

from multiworld_operator.kube.memory.planner_memory import memory_body
from multiworld_operator.planner.status import RECENT_RESTARTS, RESTART_SLOTS
from multiworld_operator.spec.limits import MAX_RESTARTS
from tests.support.planner_sim import Sim, make, seed_topology

pytestmark = pytest.mark.quick

WORLDS = 10
LEADER = "mw-leader-0"
W2_0 = "mw-w2-0"
WINDOW_S = 366 * 24 * 3600
BIG_POLICY = {"maxRestarts": MAX_RESTARTS, "window": "366d", "backoff": {"initialDelay": "0s"}}


def leader_in_every_world(policy: dict[str, object]) -> Sim:
    """The leader is rank 0 of every world: one failure of it restarts them all."""
    mw = make(
        [{"name": "leader"}, *({"name": f"m{i}"} for i in range(WORLDS))],
        [{"name": f"w{i}", "ranks": ["leader", f"m{i}"], "failurePolicy": policy} for i in range(WORLDS)],
    )
    sim = Sim(mw)
    sim.settle()
    return sim


def restart_leader(sim: Sim, times: int, every_s: float) -> None:
    for _ in range(times):
        sim.advance(every_s)
        sim.fail(LEADER)
        sim.step()
        sim.start_all()
        sim.step()


@pytest.mark.slow
def test_ten_worlds_of_ten_thousand_restarts_keep_the_memory_small() -> None:
    """A world restarted 10,000 times over a 366-day window (the most the schema allows): every
    restart still counts and the next failure exhausts it; 10 such worlds keep the memory
    ConfigMap far under 1 MiB (the whole list took about 14 bytes a restart gzipped: 1.2 MiB)."""
    sim = Sim(seed_topology(failurePolicy=BIG_POLICY))
    sim.settle()
    for _ in range(MAX_RESTARTS):
        sim.advance(WINDOW_S / MAX_RESTARTS * 0.95)
        sim.fail(W2_0)
        sim.step()
        sim.start_all()
        sim.step()
    assert sim.status is not None
    world = sim.status.worlds["world2"]
    assert world.restarts == MAX_RESTARTS
    assert world.restarts_within(sim.now - timedelta(seconds=WINDOW_S)) == MAX_RESTARTS
    assert len(world.recent_restarts) + len(world.earlier_restarts) <= RECENT_RESTARTS + RESTART_SLOTS + 1
    ten = sim.status.model_copy(update={"worlds": {f"world{i}": world for i in range(WORLDS)}})
    configmap = memory_body({"metadata": {"name": "mw", "uid": "u"}}, ten.to_dict())
    assert len(configmap["binaryData"]["status.json.gz"]) < 64 * 1024

    sim.advance(1)
    sim.fail(W2_0)
    sim.step()
    assert sim.status.worlds["world2"].phase == "Failed"  # the budget is spent


def test_restarts_leave_the_window_slot_by_slot() -> None:
    """Restarts older than the window stop counting (a slot's at most a slot's width late), so
    a world that had restarted often gets its budget back as time passes."""
    policy = {"maxRestarts": 100, "window": "1000s", "backoff": {"initialDelay": "0s"}}
    sim = leader_in_every_world(policy)
    restart_leader(sim, 100, every_s=5)  # 100 restarts within 500 s
    assert sim.status is not None
    world = sim.status.worlds["w0"]
    assert world.restarts_within(sim.now - timedelta(seconds=1000)) == 100
    sim.advance(1000 - 5 * 60)  # the first 40 restarts (200 s) are out, give or take a slot (31.25 s)
    left = world.restarts_within(sim.now - timedelta(seconds=1000))
    assert 60 <= left <= 60 + 1000 / RESTART_SLOTS / 5 + 1
    restart_leader(sim, 1, every_s=0)
    assert sim.status.worlds["w0"].phase == "Recovering"  # room again in the window
    sim.advance(1001)
    assert sim.status.worlds["w0"].restarts_within(sim.now - timedelta(seconds=1000)) == 0


def test_a_small_budget_is_decided_from_every_restart() -> None:
    """Up to RECENT_RESTARTS restarts in the window are kept one by one: exact decisions."""
    policy = {"maxRestarts": RECENT_RESTARTS, "window": "1h", "backoff": {"initialDelay": "0s"}}
    sim = leader_in_every_world(policy)
    restart_leader(sim, RECENT_RESTARTS, every_s=60)
    assert sim.status is not None
    assert all(not w.earlier_restarts for w in sim.status.worlds.values())
    assert sim.status.worlds["w0"].recent_restarts[0] == sim.now - timedelta(seconds=60 * (RECENT_RESTARTS - 1))
    restart_leader(sim, 1, every_s=60)
    assert sim.status.worlds["w0"].phase == "Failed"
