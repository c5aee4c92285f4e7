"""Each rule of the planner, on the seed topology: leader (shared, rank 0 of both worlds),
w1 x2 (exclusive to world1), w2 (exclusive to world2)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from multiworld_operator.planner import (
    Condition,
    CreatePod,
    MultiWorldStatus,
    Observation,
    StatusView,
    merge_patch,
    plan,
)
from multiworld_operator.planner.status import CUT_MARK, MAX_FAILURE_MESSAGE, MAX_MESSAGE
from multiworld_operator.spec import MultiWorld
from tests.support.planner_sim import T0, Sim, endpoint, make, seed_topology

pytestmark = pytest.mark.quick

LEADER, W1_0, W1_1, W2_0 = "mw-leader-0", "mw-w1-0", "mw-w1-1", "mw-w2-0"


def condition(status: MultiWorldStatus | None, type_: str) -> Condition:
    """The status's condition `type_`, which must be there."""
    assert status is not None
    found = status.condition(type_)
    assert found is not None, f"no {type_} condition in {status.conditions}"
    return found


def running(**world_extra: object) -> Sim:
    sim = Sim(seed_topology(**world_extra))
    sim.settle()
    assert sim.status is not None and sim.status.phase == "Running"
    return sim


def reasons(sim: Sim) -> list[tuple[str, str | None]]:
    assert sim.last is not None
    return [(e.reason, e.world) for e in sim.last.events]


# -- start ------------------------------------------------------------------------------------


def test_first_plan_creates_every_pod_with_its_assignments() -> None:
    sim = Sim(seed_topology())
    result = sim.plan()
    creates = {c.pod: c for c in result.creates}
    assert list(creates) == [LEADER, W1_0, W1_1, W2_0]
    assert creates[LEADER].created_for == {"world1": 1, "world2": 1}
    assert creates[W1_1].created_for == {"world1": 1}
    leader = {a.name: (a.rank, a.size, a.epoch, a.host, a.port) for a in creates[LEADER].worlds}
    assert leader == {"world1": (0, 3, 1, f"{LEADER}.svc", 29500), "world2": (0, 2, 1, f"{LEADER}.svc", 29500)}
    assert [(a.name, a.rank) for a in creates[W1_1].worlds] == [("world1", 2)]
    env = creates[W2_0].worker_env("local://127.0.0.1:4000")
    assert env.pod == W2_0 and env.table == "local://127.0.0.1:4000" and env.worlds[0].rank == 1
    assert creates[W1_0].template == sim.mw.template_of("w1")
    assert [p.table.revision for p in result.publishes] == [1]
    assert [w.name for w in result.table.worlds] == ["world1", "world2"]
    assert result.status.phase == "Pending" and result.status.worlds_ready == "0/2"
    assert {n: (w.epoch, w.phase, w.size) for n, w in result.status.worlds.items()} == {
        "world1": (1, "Pending", 3),
        "world2": (1, "Pending", 2),
    }
    assert result.events == [] and result.requeue_after is None
    assert result.status.observed_generation == 1


def test_actions_come_in_execution_order() -> None:
    sim = running()
    sim.fail(W1_0)
    kinds = [a.action for a in sim.plan().actions]
    assert kinds == sorted(kinds, key=["delete", "publish", "create", "event"].index)


def test_worlds_run_when_every_rank_joined_their_epoch() -> None:
    sim = Sim(seed_topology())
    sim.step()
    sim.set_phase(LEADER, "Running")
    sim.set_phase(W2_0, "Running")
    result = sim.step()
    assert sim.world_phase("world2") == "Running" and sim.world_phase("world1") == "Pending"
    assert result.status.worlds["world1"].ready_ranks == 1
    assert reasons(sim) == [("WorldReady", "world2")]
    sim.start_all()
    result = sim.step()
    assert result.status.phase == "Running" and result.status.worlds_ready == "2/2"
    assert condition(result.status, "Ready").status == "True"
    assert condition(result.status, "Degraded").status == "False"


def test_a_running_pod_that_reports_an_older_epoch_is_not_ready() -> None:
    sim = Sim(seed_topology())
    sim.step()
    sim.start_all()
    sim.pods[W2_0] = sim.pods[W2_0].model_copy(update={"joined": {}})
    result = sim.step()
    assert result.status.worlds["world2"].ready_ranks == 1 and sim.world_phase("world2") == "Pending"


# -- failures ---------------------------------------------------------------------------------


def test_exclusive_pod_failure_restarts_only_its_world() -> None:
    sim = running()
    sim.fail(W1_0)
    result = sim.plan()
    assert {d.pod for d in result.deletes} == {W1_0}  # only the dead pod: its live sibling stays
    assert result.creates == []  # a pod is recreated once the old one is gone
    assert sim.epoch("world1") == 1 and result.status.worlds["world1"].epoch == 2
    assert result.status.worlds["world2"].epoch == 1 and result.status.worlds["world2"].phase == "Running"
    world1 = result.status.worlds["world1"]
    assert world1.phase == "Recovering" and world1.restarts == 1 and result.status.restarts == 1
    failure = world1.last_failure
    assert failure is not None
    assert (failure.reason, failure.pod, failure.rank, failure.epoch, failure.time) == ("PodFailed", W1_0, 1, 1, T0)
    assert [e.reason for e in result.events] == ["WorldFailed"] and result.events[0].type == "Warning"
    assert "restarting at epoch 2" in result.events[0].message
    assert result.status.phase == "Recovering" and condition(result.status, "Degraded").status == "True"
    assert [(w.name, w.epoch) for w in result.publishes[0].table.worlds] == [("world1", 2), ("world2", 1)]


def test_the_table_names_which_instance_of_each_pod_holds_its_rank() -> None:
    """A replaced pod's old process may still run (on Kubernetes, until its node kills it): the
    table says the rank belongs to the instance created for the new epoch."""
    sim = running()
    (first,) = [w for w in sim.plan().status.table.worlds if w.name == "world1"]
    assert first.instances == {LEADER: 1, W1_0: 1, W1_1: 1}
    sim.fail(W1_0)
    table = sim.plan().publishes[0].table
    world1, world2 = table.worlds
    assert world1.instances == {LEADER: 1, W1_0: 2, W1_1: 1}
    assert world2.instances == {LEADER: 1, W2_0: 1}
    assert table.replaced(W1_0, {"world1": 1}) == ["world1"]
    assert table.replaced(W1_1, {"world1": 1}) == []  # kept: it joins epoch 2 as it is
    assert table.replaced(LEADER, {"world1": 1, "world2": 1}) == []
    assert table.replaced(W1_0, {"world1": 2}) == []


def test_replaced_pods_come_back_at_the_new_epoch_and_the_world_recovers() -> None:
    sim = running()
    sim.fail(W1_0)
    sim.step()
    result = sim.step()
    assert {c.pod: c.created_for for c in result.creates} == {W1_0: {"world1": 2}}
    assert all(a.epoch == 2 for c in result.creates for a in c.worlds)
    sim.start_all()
    result = sim.step()
    assert reasons(sim) == [("WorldRecovered", "world1")]
    assert "epoch 2" in result.events[0].message
    assert result.status.phase == "Running" and sim.epoch("world1") == 2 and sim.epoch("world2") == 1


def test_deleted_pod_counts_as_a_failure() -> None:
    sim = running()
    sim.vanish(W2_0)
    result = sim.step()
    failure = result.status.worlds["world2"].last_failure
    assert failure is not None and failure.reason == "PodDeleted" and failure.pod == W2_0
    assert sim.epoch("world2") == 2 and sim.epoch("world1") == 1
    assert [c.pod for c in result.creates] == [W2_0]  # already gone: recreated at once
    assert result.creates[0].created_for == {"world2": 2}


def test_missing_phase_is_the_same_as_absent() -> None:
    sim = running()
    sim.set_phase(W2_0, "Missing")
    result = sim.plan()
    failure = result.status.worlds["world2"].last_failure
    assert failure is not None and failure.reason == "PodDeleted"


def test_shared_pod_failure_fails_every_world_it_is_in() -> None:
    sim = running()
    sim.fail(LEADER)
    result = sim.step()
    assert (sim.epoch("world1"), sim.epoch("world2")) == (2, 2)
    # Only the dead pod goes: the others join both worlds' epoch 2.
    assert {d.pod for d in result.deletes} == {LEADER}
    assert not any(d.silent for d in result.deletes)  # it exited: its node may take the replacement
    assert [e.world for e in result.events] == ["world1", "world2"]
    result = sim.step()
    assert {c.pod: c.created_for for c in result.creates} == {LEADER: {"world1": 2, "world2": 2}}
    sim.settle()
    assert sim.status is not None and sim.status.phase == "Running"


def test_replace_world_restarts_every_pod_of_the_world_that_no_healthy_world_holds() -> None:
    """`failurePolicy.replace: World`, for programs that must restart together: the dead pod and
    its exclusive siblings go; the shared leader, alive in the healthy world2, stays."""
    sim = running(failurePolicy={"replace": "World"})
    sim.fail(W1_0)
    result = sim.step()
    assert {d.pod for d in result.deletes} == {W1_0, W1_1}
    assert sim.epoch("world2") == 1 and sim.world_phase("world2") == "Running"
    result = sim.step()
    assert {c.pod: c.created_for for c in result.creates} == {W1_0: {"world1": 2}, W1_1: {"world1": 2}}
    sim.fail(LEADER)
    sim.settle()
    sim.fail(LEADER)
    result = sim.step()
    # The shared pod's death leaves no world of any pod up: all are replaced.
    assert {d.pod for d in result.deletes} == {LEADER, W1_0, W1_1, W2_0}


def test_shared_pod_dying_after_one_of_its_worlds_moved_on_fails_that_world_once() -> None:
    """The leader dies: world2's worker reports it first, so world2 moves to epoch 2 keeping the
    leader (world1 still looked healthy); then the leader's exit shows. world1 fails; world2,
    whose epoch 2 the dead instance never joined, is not failed again: the new leader joins it."""
    sim = running()
    sim.report("world2", epoch=1, pod=W2_0, peer_rank=0)
    sim.step()
    assert sim.epoch("world2") == 2
    sim.fail(LEADER)
    result = sim.step()
    assert (sim.epoch("world1"), sim.epoch("world2")) == (2, 2)
    # The event's epoch: the one its world restarts at (the operator's log line carries it).
    assert [(e.reason, e.world, e.epoch) for e in result.events] == [("WorldFailed", "world1", 2)]
    assert result.status.worlds["world2"].restarts == 1
    result = sim.step()
    assert {c.pod: c.created_for for c in result.creates}[LEADER] == {"world1": 2, "world2": 2}
    sim.settle()
    assert sim.status is not None and sim.status.phase == "Running"
    assert (sim.epoch("world1"), sim.epoch("world2")) == (2, 2)


def test_report_at_current_epoch_fails_the_world_and_keeps_the_shared_pod() -> None:
    sim = running()
    sim.report("world2", epoch=1, pod=W2_0, peer_rank=0)
    result = sim.step()
    # The named leader holds a rank in the healthy world1 (a frozen process would break that
    # too): it stays, as does the reporter; both join world2's epoch 2.
    assert result.deletes == []
    assert sim.epoch("world2") == 2 and sim.epoch("world1") == 1
    failure = result.status.worlds["world2"].last_failure
    assert failure is not None
    assert (failure.reason, failure.pod, failure.rank) == ("WorldBroken", LEADER, 0)
    assert "peer timed out" in failure.message and W2_0 in failure.message


def test_a_shared_pod_its_worlds_name_a_step_apart_is_replaced() -> None:
    """A leader cut off the network: world2's peer names it first, and it stays (world1 still
    runs); world1's peer names it a step later. world2 has not formed again since, so no world
    shows the leader alive: it goes now, not at the join timeout."""
    sim = running()
    sim.frozen.add(LEADER)
    sim.report("world2", epoch=1, pod=W2_0, peer_rank=0)
    assert sim.step().deletes == []
    sim.report("world1", epoch=1, pod=W1_0, peer_rank=0)
    (delete,) = sim.step().deletes
    assert (delete.pod, delete.reason) == (LEADER, "named by a peer as the culprit of world world1 epoch 1")
    assert delete.silent  # its host may be gone: the platform places the replacement elsewhere
    assert (sim.epoch("world1"), sim.epoch("world2")) == (2, 2)


def test_an_unschedulable_pod_is_told_with_its_member_and_the_gpus_it_asks_for() -> None:
    """The scheduler counts nodes ("Insufficient nvidia.com/gpu"); the status and the Event
    add which member and how many GPUs each of its pods asks for."""
    gpus = {"spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 6}}}]}}
    sim = Sim(
        make(
            [{"name": "leader"}, {"name": "w1", "replicas": 2, "template": gpus}],
            [{"name": "world1", "ranks": ["leader", "w1"], "backend": "gloo"}],
        )
    )
    sim.step()
    sim.start_all()
    scheduler = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    sim.pods[W1_1] = sim.pods[W1_1].model_copy(
        update={"phase": "Pending", "joined": None, "waiting": f"Unschedulable: {scheduler}"}
    )
    result = sim.step()
    said = f"Unschedulable (member w1, 6 nvidia.com/gpu a pod): {scheduler}"
    assert result.status.worlds["world1"].waiting == {W1_1: said}
    (waiting,) = [e.message for e in result.events if e.reason == "WorldWaiting"]
    assert waiting == f"world world1 epoch 1 waits for pod {W1_1}: {said}"


def test_a_lost_node_is_said_in_a_condition_while_the_platform_says_it_was_lost_lately() -> None:
    """No NodeLost condition before any node is lost; True, naming each node and when, while
    the platform says so; False (its time the moment it changed) once it no longer does."""
    sim = Sim(seed_topology())
    sim.step()
    sim.start_all()
    assert sim.step().status.condition("NodeLost") is None
    sim.advance(5)
    sim.lost_nodes = {"node-b": sim.now - timedelta(seconds=1), "node-a": sim.now}
    lost = condition(sim.step().status, "NodeLost")
    assert (lost.status, lost.reason, lost.last_transition_time) == ("True", "NodesLost", sim.now)
    assert lost.message == (
        "lost: node node-a at 2024-05-01T12:00:05Z; node node-b at 2024-05-01T12:00:04Z; "
        "the pods there are replaced on other nodes"
    )
    sim.advance(120)
    sim.lost_nodes = {}
    gone = condition(sim.step().status, "NodeLost")
    assert (gone.status, gone.reason, gone.last_transition_time) == ("False", "NoNodeLost", sim.now)


# failurePolicy.joinTimeout's default: the planner looks again then at a kept pod not seen joining.
JOIN_TIMEOUT_S = 300.0
JOIN_TIMED_OUT = "join failed: world 'world1' epoch 1: timed out waiting for rank(s) 2"


def test_slow_scheduling_is_not_a_failure() -> None:
    """A rank's pod still Pending (unschedulable here): the world waits, says for whom and why
    (an Event once), and its members' join timeouts are no failures, then or later."""
    sim = Sim(seed_topology())
    sim.step()
    sim.start_all()
    sim.pods[W1_1] = sim.pods[W1_1].model_copy(
        update={
            "phase": "Pending",
            "joined": None,
            "waiting": "Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu",
        }
    )
    result = sim.step()
    world1 = result.status.worlds["world1"]
    # The scheduler's words, with the member and what each of its pods asks for.
    said = "Unschedulable (member w1): 0/1 nodes are available: 1 Insufficient nvidia.com/gpu"
    assert world1.phase == "Pending" and world1.waiting == {W1_1: said}
    assert sorted(reasons(sim)) == [("WorldReady", "world2"), ("WorldWaiting", "world1")]
    (waiting,) = [e.message for e in result.events if e.reason == "WorldWaiting"]
    assert f"pod {W1_1}: {said}" in waiting
    sim.advance(300)
    sim.report("world1", epoch=1, pod=LEADER, reason=JOIN_TIMED_OUT)
    result = sim.step()
    assert sim.epoch("world1") == 1 and reasons(sim) == []  # no failure, and no second WorldWaiting
    sim.advance(30)
    sim.start_all()  # the pod got its GPU: it starts after the report was made
    sim.pods[W1_1] = sim.pods[W1_1].model_copy(update={"started": sim.now})
    result = sim.step()
    assert sim.epoch("world1") == 1 and result.status.worlds["world1"].phase == "Running"
    assert result.status.worlds["world1"].waiting == {}


def test_messages_the_status_keeps_are_cut_to_the_length_the_caps_assume() -> None:
    """A crash's termination message (kubelet keeps up to 4 KiB of it), a report's reason and a
    pod's reason to wait are cut, with a mark, where the status keeps them; a restored status is
    cut the same way."""
    long = "x" * 4000
    sim = running()
    sim.pods[W1_0] = sim.pods[W1_0].model_copy(update={"phase": "Failed", "message": long})
    sim.report("world2", epoch=1, pod=W2_0, reason=long)
    result = sim.step()
    for world in ("world1", "world2"):
        failure = result.status.worlds[world].last_failure
        assert failure is not None and len(failure.message) == MAX_FAILURE_MESSAGE, failure
        assert failure.message.endswith(CUT_MARK) and "xxx" in failure.message
    sim.pods[W1_1] = sim.pods[W1_1].model_copy(update={"phase": "Pending", "joined": None, "waiting": long})
    waiting = sim.step().status.worlds["world1"].waiting[W1_1]
    assert len(waiting) == MAX_MESSAGE and waiting.endswith(CUT_MARK)
    stored = result.status.to_dict()
    stored["worlds"]["world1"]["lastFailure"]["message"] = long
    loaded = MultiWorldStatus.from_dict(stored)
    assert loaded is not None
    restored = loaded.worlds["world1"].last_failure
    assert restored is not None and len(restored.message) == MAX_FAILURE_MESSAGE


def test_a_join_timeout_while_every_rank_ran_is_a_failure() -> None:
    sim = running()
    sim.advance(300)
    sim.report("world1", epoch=1, pod=LEADER, reason=JOIN_TIMED_OUT)
    sim.step()
    assert sim.epoch("world1") == 2


def test_report_without_peer_names_the_reporter() -> None:
    sim = running()
    sim.report("world1", epoch=1, pod=W1_1)
    failure = sim.plan().status.worlds["world1"].last_failure
    assert failure is not None and (failure.pod, failure.rank) == (W1_1, 2)


def test_reports_for_old_epochs_or_unknown_worlds_are_ignored() -> None:
    sim = running()
    sim.report("world2", epoch=1)
    sim.settle()
    assert sim.epoch("world2") == 2
    sim.report("world2", epoch=1)  # the old report is still around, plus one more
    sim.report("nowhere", epoch=2)
    sim.report("world1", epoch=7)
    result = sim.step()
    assert result.actions == [] and sim.epoch("world2") == 2 and sim.epoch("world1") == 1


def test_one_restart_per_world_however_many_causes() -> None:
    sim = running()
    sim.fail(W1_0)
    sim.vanish(W1_1)
    sim.report("world1", epoch=1)
    result = sim.step()
    assert sim.epoch("world1") == 2 and result.status.worlds["world1"].restarts == 1
    assert [e.reason for e in result.events] == ["WorldFailed"]


def test_pod_not_created_yet_is_not_a_failure() -> None:
    sim = Sim(seed_topology())
    first = sim.plan()  # the platform has not executed it
    second = plan(sim.mw, first.status, Observation(now=T0), endpoint=endpoint)
    assert [c.pod for c in second.creates] == [c.pod for c in first.creates]
    assert second.events == [] and all(w.epoch == 1 for w in second.status.worlds.values())


def test_leftover_instance_is_deleted_before_ours_is_created() -> None:
    sim = Sim(seed_topology())
    sim.step()
    # An instance from an earlier life of this MultiWorld still holds the name.
    sim.pods[W2_0] = sim.pods[W2_0].model_copy(update={"created_for": {"world2": 99}, "phase": "Running"})
    result = sim.step()
    assert [d.pod for d in result.deletes] == [W2_0] and "outdated" in result.deletes[0].reason
    assert W2_0 not in {c.pod for c in result.creates}
    assert sim.epoch("world2") == 1 and result.events == []
    result = sim.step()
    assert [c.pod for c in result.creates] == [W2_0] and result.creates[0].created_for == {"world2": 1}


def test_our_instance_replaced_by_a_foreign_one_is_a_deletion() -> None:
    sim = running()
    sim.pods[W2_0] = sim.pods[W2_0].model_copy(update={"created_for": {}})
    result = sim.step()
    failure = result.status.worlds["world2"].last_failure
    assert failure is not None and failure.reason == "PodDeleted"
    assert [d.pod for d in result.deletes] == [W2_0] and sim.epoch("world2") == 2


def test_pods_outside_the_spec_are_deleted() -> None:
    sim = running()
    stray = sim.pods[W2_0].model_copy(update={"name": "mw-ghost-0", "member": "ghost"})
    sim.pods["mw-ghost-0"] = stray
    result = sim.step()
    assert [(d.pod, d.reason) for d in result.deletes] == [("mw-ghost-0", "not part of the spec")]


# -- failure policy ---------------------------------------------------------------------------


def test_exhausted_world_fails_alone() -> None:
    sim = running(failurePolicy={"maxRestarts": 1})
    sim.fail(W2_0)
    sim.settle()
    assert sim.epoch("world2") == 2
    sim.advance(5)
    sim.fail(W2_0)
    result = sim.step()
    world2 = result.status.worlds["world2"]
    assert world2.phase == "Failed" and world2.epoch == 2 and world2.restarts == 1
    assert [(e.reason, e.world) for e in result.events] == [("WorldExhausted", "world2")]
    assert [d.pod for d in result.deletes] == [W2_0]
    assert [w.name for w in result.table.worlds] == ["world1"]
    assert result.status.phase == "Degraded" and result.status.worlds_ready == "1/2"
    assert condition(result.status, "Degraded").status == "True"
    assert sim.epoch("world1") == 1 and sim.world_phase("world1") == "Running"
    # The exhausted world's pod is not recreated; the shared leader keeps running.
    result = sim.step()
    assert result.creates == [] and result.deletes == [] and LEADER in sim.pods


def test_exhausted_world_removes_its_live_exclusive_pods() -> None:
    sim = running(failurePolicy={"maxRestarts": 0})
    sim.report("world1", epoch=1)
    result = sim.step()
    assert sim.world_phase("world1") == "Failed"
    assert {d.pod for d in result.deletes} == {W1_0, W1_1}
    assert set(result.status.pods) == {LEADER, W2_0}


def test_all_worlds_exhausted_is_failed() -> None:
    sim = running(failurePolicy={"maxRestarts": 0})
    sim.fail(LEADER)
    result = sim.step()
    assert result.status.phase == "Failed" and result.table.worlds == []
    assert {d.pod for d in result.deletes} == set(sim.mw.all_pods()) and result.status.pods == {}
    assert sim.step().actions == []  # nothing is recreated


def test_restarts_older_than_the_window_do_not_count() -> None:
    sim = running(failurePolicy={"maxRestarts": 1, "window": "10m"})
    sim.fail(W2_0)
    sim.settle()
    sim.advance(601)
    sim.fail(W2_0)
    result = sim.step()
    assert sim.world_phase("world2") == "Recovering" and sim.epoch("world2") == 3
    assert result.status.worlds["world2"].restarts == 2
    assert result.status.worlds["world2"].recent_restarts == [sim.now]
    assert result.status.worlds["world2"].restart_at is None  # the window is empty again: no backoff
    assert result.requeue_after == JOIN_TIMEOUT_S  # the kept leader's join is still to be seen


def test_backoff_delays_the_second_restart() -> None:
    sim = running(failurePolicy={"backoff": {"initialDelay": "10s", "maxDelay": "1m"}})
    sim.fail(W2_0)
    sim.settle()
    sim.advance(3)
    sim.fail(W2_0)
    result = sim.step()
    assert sim.epoch("world2") == 3 and result.status.worlds["world2"].restart_at is not None
    assert result.requeue_after == 10
    # In the table at its new epoch (the kept leader waits there), but no new pod before the end.
    assert [(w.name, w.epoch) for w in result.table.worlds] == [("world1", 1), ("world2", 3)]
    assert result.creates == []
    assert "in 10s" in result.events[0].message
    sim.advance(4)
    result = sim.step()
    assert result.creates == [] and result.requeue_after == 6
    sim.report("world2", epoch=3)  # a world waiting for its backoff cannot fail
    result = sim.step()
    assert result.actions == [] and sim.epoch("world2") == 3
    sim.reports.clear()
    sim.advance(6)
    result = sim.step()
    assert [(e.reason, e.world) for e in result.events] == [("WorldRestarting", "world2")]
    assert [(w.name, w.epoch) for w in result.table.worlds] == [("world1", 1), ("world2", 3)]
    assert [(c.pod, c.created_for) for c in result.creates] == [(W2_0, {"world2": 3})]
    assert result.requeue_after is None and sim.epoch("world2") == 3  # the leader joins already


def test_backoff_grows_and_is_capped() -> None:
    sim = running(failurePolicy={"maxRestarts": 10, "backoff": {"initialDelay": "2s", "maxDelay": "5s"}})
    waits = []
    for _ in range(4):
        sim.fail(W2_0)
        result = sim.step()
        waits.append(result.requeue_after)
        sim.advance(result.requeue_after or 0)
        sim.settle()
    assert waits == [JOIN_TIMEOUT_S, 2, 4, 5]  # no backoff first: the planner looks again at the join timeout
    assert sim.epoch("world2") == 5 and sim.world_phase("world2") == "Running"


def test_shared_pod_alive_in_a_healthy_world_is_kept_while_the_other_backs_off() -> None:
    sim = running(failurePolicy={"backoff": {"initialDelay": "30s"}})
    sim.fail(W2_0)
    sim.settle()
    sim.fail(W2_0)
    result = sim.step()
    assert LEADER not in {d.pod for d in result.deletes}
    assert sim.world_phase("world1") == "Running"


# -- completion -------------------------------------------------------------------------------


def test_world_succeeds_when_every_rank_finished() -> None:
    sim = running()
    for pod in (LEADER, W2_0):
        sim.set_phase(pod, "Succeeded")
    result = sim.step()
    assert sim.world_phase("world2") == "Succeeded" and result.deletes == [] and result.creates == []
    assert [w.name for w in result.table.worlds] == ["world1"]
    for pod in (W1_0, W1_1):
        sim.set_phase(pod, "Succeeded")
    result = sim.step()
    assert result.status.phase == "Succeeded"
    assert [e.reason for e in result.events] == ["WorldSucceeded"]


# -- spec edits -------------------------------------------------------------------------------


def edit(sim: Sim, members: list[dict[str, object]], worlds: list[dict[str, object]]) -> None:
    sim.mw = make(members, worlds)


SEED_MEMBERS: list[dict[str, object]] = [{"name": "leader"}, {"name": "w1", "replicas": 2}, {"name": "w2"}]
SEED_WORLDS: list[dict[str, object]] = [
    {"name": "world1", "ranks": ["leader", "w1"]},
    {"name": "world2", "ranks": ["leader", "w2"]},
]


def test_adding_a_world_and_member_touches_nothing_else() -> None:
    sim = running()
    edit(sim, [*SEED_MEMBERS, {"name": "w3"}], [*SEED_WORLDS, {"name": "world3", "ranks": ["leader", "w3"]}])
    result = sim.step()
    assert [c.pod for c in result.creates] == ["mw-w3-0"] and result.deletes == []
    assert result.creates[0].created_for == {"world3": 1}
    assert (sim.epoch("world1"), sim.epoch("world2"), sim.epoch("world3")) == (1, 1, 1)
    assert [(e.reason, e.world) for e in result.events] == [("WorldAdded", "world3")]
    assert [w.name for w in result.publishes[0].table.worlds] == ["world1", "world2", "world3"]
    sim.start_all()
    sim.step()
    assert sim.status is not None and sim.status.phase == "Running" and sim.status.worlds_ready == "3/3"


def test_removing_a_world_and_its_member_deletes_only_their_pods() -> None:
    sim = running()
    edit(sim, SEED_MEMBERS[:2], SEED_WORLDS[:1])
    result = sim.step()
    assert [d.pod for d in result.deletes] == [W2_0] and result.creates == []
    assert list(result.status.worlds) == ["world1"] and sim.epoch("world1") == 1
    assert [(e.reason, e.world) for e in result.events] == [("WorldRemoved", "world2")]
    assert [w.name for w in result.table.worlds] == ["world1"]
    assert set(result.status.pods) == {LEADER, W1_0, W1_1}


def test_changed_rank_list_gets_a_new_epoch_without_restarting_pods() -> None:
    sim = running()
    edit(sim, [SEED_MEMBERS[0], {"name": "w1", "replicas": 3}, SEED_MEMBERS[2]], SEED_WORLDS)
    result = sim.step()
    assert [c.pod for c in result.creates] == ["mw-w1-2"] and result.deletes == []
    assert result.creates[0].created_for == {"world1": 2}
    assert (sim.epoch("world1"), sim.epoch("world2")) == (2, 1)
    assert result.status.worlds["world1"].size == 4 and result.status.worlds["world1"].restarts == 0
    assert [(e.reason, e.world) for e in result.events] == [("WorldChanged", "world1")]
    sim.start_all()
    result = sim.step()
    assert sim.world_phase("world1") == "Running" and result.status.restarts == 0


def test_scaling_down_deletes_the_extra_pods() -> None:
    sim = running()
    edit(sim, [SEED_MEMBERS[0], {"name": "w1", "replicas": 1}, SEED_MEMBERS[2]], SEED_WORLDS)
    result = sim.step()
    assert [(d.pod, d.reason) for d in result.deletes] == [(W1_1, "not part of the spec")]
    assert result.status.worlds["world1"].pods == [LEADER, W1_0] and sim.epoch("world1") == 2


def test_editing_a_failed_world_revives_it() -> None:
    sim = running(failurePolicy={"maxRestarts": 0})
    sim.fail(W2_0)
    sim.step()
    assert sim.world_phase("world2") == "Failed"
    edit(
        sim,
        [*SEED_MEMBERS[:2], {"name": "w2", "replicas": 2}],
        [{**world, "failurePolicy": {"maxRestarts": 0}} for world in SEED_WORLDS],
    )
    result = sim.step()
    assert sim.world_phase("world2") == "Pending" and sim.epoch("world2") == 2
    assert {c.pod for c in result.creates} == {W2_0, "mw-w2-1"}


def test_observed_generation_follows_the_spec() -> None:
    sim = running()
    sim.mw = sim.mw.model_copy(update={"metadata": sim.mw.metadata.model_copy(update={"generation": 4})})
    assert sim.step().status.observed_generation == 4


# -- platform choices -------------------------------------------------------------------------


def test_backend_resolver_and_endpoint_are_the_platforms() -> None:
    mw = seed_topology()
    calls: list[tuple[str, str]] = []

    def local_endpoint(world: str, rank0: str) -> tuple[str, int]:
        calls.append((world, rank0))
        return "127.0.0.1", {"world1": 4001, "world2": 4002}[world]

    result = plan(
        mw,
        None,
        Observation(now=T0),
        endpoint=local_endpoint,
        backend_of=lambda w: mw.local_backend_of(w, cuda_available=True)[0],
    )
    assert sorted(set(calls)) == [("world1", LEADER), ("world2", LEADER)]
    assert [(w.backend, w.port) for w in result.table.worlds] == [("nccl", 4001), ("nccl", 4002)]


def test_backend_change_is_a_new_epoch() -> None:
    sim = running()
    result = plan(sim.mw, sim.status, sim.observation(), endpoint=endpoint, backend_of=lambda w: "nccl")
    assert {n: w.epoch for n, w in result.status.worlds.items()} == {"world1": 2, "world2": 2}
    assert result.deletes == [] and result.creates == []


# -- status storage ---------------------------------------------------------------------------


def backing_off() -> Sim:
    """world2 failed twice: its second restart waits 10s."""
    sim = running(failurePolicy={"backoff": {"initialDelay": "10s"}})
    sim.fail(W2_0)
    sim.settle()
    sim.fail(W2_0)
    sim.step()
    return sim


def test_status_round_trips_through_the_cr_dict() -> None:
    status = backing_off().status
    assert status is not None
    stored = status.to_dict()
    world2 = stored["worlds"]["world2"]
    assert world2["restartAt"] and world2["lastFailure"]["reason"] == "PodFailed"
    assert MultiWorldStatus.from_dict(stored) == status
    assert MultiWorldStatus.from_dict(None) is None and MultiWorldStatus.from_dict({}) is None


def test_merge_patch_removes_what_the_new_status_dropped_and_sends_only_changes() -> None:
    sim = backing_off()
    waiting = sim.status
    assert waiting is not None
    sim.advance(10)
    restarted = sim.step().status
    patch = merge_patch(waiting.view(), restarted.view())
    assert patch["worlds"]["world2"]["restartAt"] is None
    assert "world1" not in patch["worlds"]  # untouched: not in the patch
    assert _apply_merge_patch(waiting.view(), patch) == restarted.view()
    memory = merge_patch(waiting.to_dict(), restarted.to_dict())
    assert memory["pods"][W2_0]["createdFor"] == {"world2": 3}
    assert _apply_merge_patch(waiting.to_dict(), memory) == restarted.to_dict()


def test_the_view_is_what_kubectl_shows_and_no_more() -> None:
    sim = backing_off()
    assert sim.status is not None
    view = sim.status.view()
    assert set(view) == {"phase", "observedGeneration", "worldsReady", "restarts", "worlds", "conditions", "updated"}
    backing_off_shows = {"phase", "epoch", "size", "readyRanks", "restarts", "lastFailure", "restartAt"}
    assert set(view["worlds"]["world2"]) == backing_off_shows
    assert "waiting" not in view["worlds"]["world1"]  # shown only while a world waits
    # The CRD's status schema is generated from StatusView: the view is one of its instances.
    assert StatusView.model_validate(view).worlds["world2"].restart_at == sim.status.worlds["world2"].restart_at


def _apply_merge_patch(target: dict[str, object], patch: dict[str, object]) -> dict[str, object]:
    """RFC 7386, as the API server applies it."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(current := out.get(key), dict):
            out[key] = _apply_merge_patch(current, value)
        else:
            out[key] = value
    return out


def test_condition_transition_time_only_moves_on_change() -> None:
    sim = running()
    ready_since = condition(sim.status, "Ready").last_transition_time
    sim.advance(60)
    sim.step()
    assert condition(sim.status, "Ready").last_transition_time == ready_since
    sim.fail(W2_0)
    sim.step()
    assert condition(sim.status, "Ready").status == "False"
    assert condition(sim.status, "Ready").last_transition_time == sim.now


def test_create_pod_round_trips_as_json() -> None:
    create = Sim(seed_topology()).plan().creates[0]
    assert CreatePod.model_validate_json(create.model_dump_json()) == create


# -- warm spares ------------------------------------------------------------------------------


def with_spares(w1_spares: int = 2, template: dict[str, Any] | None = None) -> Sim:
    """The seed topology with w1 keeping warm spares, every pod and spare running."""
    members: list[dict[str, Any]] = [
        {"name": "leader"},
        {"name": "w1", "replicas": 2, "spares": w1_spares},
        {"name": "w2"},
    ]
    if template is not None:
        members[1]["template"] = template
    sim = Sim(
        make(members, [{"name": "world1", "ranks": ["leader", "w1"]}, {"name": "world2", "ranks": ["leader", "w2"]}])
    )
    sim.settle()
    sim.start_all()
    sim.step()
    return sim


def test_a_spare_that_takes_a_published_epochs_store_host_moves_that_world_on() -> None:
    """The shared leader (with a warm spare) cut off: world2's peer names it first and world2
    moves to epoch 2 keeping it (world1 still runs), a table published with the leader as its
    store's host; world1's peer names it a step later and the spare plays it. world2's published
    epoch 2 cannot change its host (its members would wait at the old one, and a worker ignores
    such a change): world2 moves to epoch 3, no second restart counted, no backoff."""
    sim = Sim(
        make(
            [{"name": "leader", "spares": 1}, {"name": "w1", "replicas": 2}, {"name": "w2"}],
            [{"name": "world1", "ranks": ["leader", "w1"]}, {"name": "world2", "ranks": ["leader", "w2"]}],
        )
    )
    sim.settle()
    sim.start_all()
    sim.step()
    sim.frozen.add(LEADER)
    sim.report("world2", epoch=1, pod=W2_0, peer_rank=0)
    published = {w.name: w for w in sim.step().table.worlds}["world2"]
    assert (published.epoch, published.host) == (2, endpoint("world2", LEADER)[0])
    sim.report("world1", epoch=1, pod=W1_0, peer_rank=0)
    result = sim.step()
    assert {(a.pod, a.plays) for a in result.assigns} == {("mw-leader-spare-a", LEADER)}
    entries = {w.name: w for w in result.table.worlds}
    assert (entries["world1"].epoch, entries["world2"].epoch) == (2, 3)
    for entry in entries.values():
        assert entry.host == endpoint(entry.name, "mw-leader-spare-a")[0] and entry.pods[0] == "mw-leader-spare-a"
    assert result.status.worlds["world2"].restarts == 1 and result.status.worlds["world2"].restart_at is None
    assert ("WorldRestarting", "world2") in [(e.reason, e.world) for e in result.events]
    sim.start_all()
    sim.settle()
    assert sim.world_phase("world1") == sim.world_phase("world2") == "Running"


def test_spares_wait_until_the_members_run_then_fill_the_pool() -> None:
    sim = Sim(with_spares().mw)
    assert not [c for c in sim.step().creates if c.spare], "spares compete with the first start"
    sim.start_all()
    result = sim.step()
    spares = [c for c in result.creates if c.spare]
    assert [c.pod for c in spares] == ["mw-w1-spare-a", "mw-w1-spare-b"]
    for create in spares:
        assert create.worlds == [] and create.created_for == {} and create.template == sim.mw.template_of("w1")
        assert create.worker_env("local://127.0.0.1:4000").spare == "w1"
    assert result.status.spares == {"w1": "0/2"}
    sim.start_all()
    assert sim.step().status.spares == {"w1": "2/2"}


def test_a_failed_world_is_played_by_ready_spares_and_the_pool_refills() -> None:
    sim = with_spares()
    sim.fail(W1_1)
    result = sim.step()
    # One death takes one spare: the live w1-0 stays and joins epoch 2.
    assert {(a.pod, a.plays) for a in result.assigns} == {("mw-w1-spare-a", W1_1)}
    assert not [c for c in result.creates if not c.spare], "a pod was created although spares were ready"
    (entry,) = [w for w in result.table.worlds if w.name == "world1"]
    assert entry.epoch == 2 and entry.pods == [LEADER, W1_0, "mw-w1-spare-a"]
    assert entry.plays == {"mw-w1-spare-a": W1_1}
    assert entry.instances == {LEADER: 1, W1_0: 1, "mw-w1-spare-a": 2}
    assert {d.pod: d.reason for d in result.deletes}[W1_1] == "replaced by warm spare mw-w1-spare-a"
    assert result.status.view()["playedBy"] == {W1_1: "mw-w1-spare-a"}
    assert ("SpareAssigned", None) in reasons(sim)
    sim.start_all()
    refill = sim.step()
    assert sim.world_phase("world1") == "Running"
    assert sorted(c.pod for c in refill.creates if c.spare) == ["mw-w1-spare-c"]
    # A spare that plays fails like the pod it plays; the spare that took its place is new.
    sim.start_all()
    sim.step()
    sim.fail("mw-w1-spare-a")
    failed = sim.step()
    assert sim.status is not None and sim.status.worlds["world1"].last_failure is not None
    assert sim.status.worlds["world1"].last_failure.pod == "mw-w1-spare-a"
    assert {d.pod for d in failed.deletes} == {"mw-w1-spare-a"}
    assert not failed.assigns, "a world waiting out its backoff takes no spare"
    sim.advance(1)  # the second restart within the window waits 1 s
    result = sim.step()
    assert {a.plays: a.pod for a in result.assigns} == {W1_1: "mw-w1-spare-b"}


def test_without_a_ready_spare_the_pod_is_created_as_before() -> None:
    sim = with_spares()
    sim.set_phase("mw-w1-spare-a", "Pending")
    sim.pods["mw-w1-spare-b"] = sim.pods["mw-w1-spare-b"].model_copy(update={"warm": False})
    sim.fail(W1_1)
    sim.step()
    result = sim.step()
    assert not result.assigns
    assert sorted(c.pod for c in result.creates) == [W1_1]


def test_spares_of_an_older_template_are_deleted_and_never_play() -> None:
    sim = with_spares()
    edited = {"spec": {"containers": [{"name": "c", "image": "y"}]}}
    sim.mw = with_spares(template=edited).mw
    sim.fail(W1_1)
    result = sim.step()
    assert not result.assigns
    deleted = {d.pod: d.reason for d in result.deletes}
    assert deleted["mw-w1-spare-a"] == "a warm spare of an older template of member w1"
    for _ in range(8):  # the rollout replaces w1-0 too; then the pool refills
        sim.step()
        sim.start_all()
    assert sim.step().status.spares == {"w1": "2/2"}
    assert sim.status is not None and sim.status.updated == "4/4"
    assert all(sim.mw.template_digest("w1") == s.template for s in sim.status.spare_pool.values())


def test_spares_go_when_their_members_worlds_are_done_and_zero_spares_changes_nothing() -> None:
    sim = with_spares()
    for pod in (LEADER, W1_0, W1_1, W2_0):
        sim.set_phase(pod, "Succeeded")
    result = sim.step()
    assert sim.world_phase("world1") == "Succeeded"
    assert sorted(d.pod for d in result.deletes) == ["mw-w1-spare-a", "mw-w1-spare-b"]
    plain, spared = running(), with_spares(0)
    assert plain.status is not None and spared.status is not None
    assert spared.status.view() == plain.status.view() and not spared.status.spare_pool


def test_a_spare_that_plays_rank_0_hosts_the_rendezvous_under_its_own_name() -> None:
    sim = Sim(make([{"name": "a", "spares": 1}, {"name": "b"}], [{"name": "w", "ranks": ["a", "b"]}]))
    sim.settle()
    sim.start_all()
    sim.step()
    sim.start_all()
    sim.fail("mw-a-0")
    (entry,) = sim.step().table.worlds
    assert entry.pods == ["mw-a-spare-a", "mw-b-0"] and entry.host == "mw-a-spare-a.svc"
    assert entry.assignment("mw-a-spare-a").rank == 0


# -- which pods a failure replaces (failurePolicy.replace: Pod) ------------------------------


def test_a_pod_named_by_a_live_peer_is_replaced_and_the_others_stay() -> None:
    """A frozen w1-1 is Running to the platform: the leader names it (rank 2) and it goes."""
    sim = running()
    sim.frozen.add(W1_1)
    sim.report("world1", epoch=1, pod=LEADER, peer_rank=2)
    result = sim.step()
    assert {d.pod: d.reason for d in result.deletes} == {W1_1: "named by a peer as the culprit of world world1 epoch 1"}
    assert ("PodReplaced", None) in reasons(sim) and sim.epoch("world2") == 1
    sim.frozen.clear()
    sim.settle()
    assert sim.world_phase("world1") == "Running" and sim.epoch("world1") == 2


def test_two_pods_that_name_each_other_cancel_out_and_the_join_timeout_decides() -> None:
    """A partition: w1-0 names w1-1 and w1-1 names w1-0. Neither is replaced on that word; the
    one that cannot join the new epoch (here w1-1, frozen) goes after joinTimeout."""
    sim = running(failurePolicy={"joinTimeout": "30s"})
    sim.frozen.add(W1_1)
    sim.report("world1", epoch=1, pod=W1_0, peer_rank=2)
    sim.report("world1", epoch=1, pod=W1_1, peer_rank=1)
    result = sim.step()
    assert result.deletes == [] and sim.epoch("world1") == 2
    assert result.requeue_after == 30
    sim.start_all()  # every live worker joins what it can; the frozen one does not
    sim.advance(29)
    assert sim.step().deletes == []
    sim.advance(1)
    result = sim.step()
    assert {d.pod: d.reason for d in result.deletes} == {W1_1: "did not join world world1 epoch 2 within 30s"}
    assert sim.epoch("world1") == 2, "a late joiner's replacement joins the same epoch"
    sim.frozen.clear()
    sim.settle()
    assert sim.world_phase("world1") == "Running" and sim.epoch("world2") == 1


def test_a_kept_pod_that_is_joining_is_never_timed_out() -> None:
    """w1-0 is joining epoch 2 while the replacement of w1-1 takes long to start (a model to
    load): nobody is replaced for the wait."""
    sim = running(failurePolicy={"joinTimeout": "10s"})
    sim.fail(W1_1)
    sim.step()
    sim.step()  # w1-1 recreated: Pending
    sim.advance(3600)
    result = sim.step()
    assert result.deletes == [] and sim.pods[W1_0].joining == {"world1": 2}


def test_a_kept_shared_pod_silent_past_the_timeout_takes_its_other_worlds_along() -> None:
    sim = running(failurePolicy={"joinTimeout": "10s"})
    sim.frozen.add(LEADER)
    sim.fail(W1_1)
    sim.step()
    sim.advance(10)
    result = sim.step()
    assert [d.pod for d in result.deletes] == [LEADER]
    failure = result.status.worlds["world2"].last_failure
    assert failure is not None and failure.reason == "PodReplaced" and sim.epoch("world2") == 2


def test_a_pod_that_ends_after_its_world_broke_is_replaced_without_a_second_failure() -> None:
    """The program stops when its world breaks (exit 0): its pod is replaced, the world's epoch
    stays, and the world recovers with the new instance."""
    sim = running()
    sim.fail(W1_1)
    sim.step()
    sim.set_phase(W1_0, "Succeeded")
    result = sim.step()
    assert {d.pod: d.reason for d in result.deletes} == {W1_0: "ended before it joined world world1 epoch 2"}
    assert sim.epoch("world1") == 2 and result.status.worlds["world1"].restarts == 1
    sim.settle()
    assert sim.world_phase("world1") == "Running" and sim.epoch("world1") == 2


# -- suspend and resume -----------------------------------------------------------------------


def suspended(mw: MultiWorld, suspend: bool) -> MultiWorld:
    return mw.model_copy(update={"spec": mw.spec.model_copy(update={"suspend": suspend})})


def test_suspend_deletes_every_pod_and_spare_and_keeps_each_worlds_history() -> None:
    sim = with_spares()
    sim.fail(W2_0)
    sim.settle()
    sim.start_all()
    sim.step()
    history = {n: (w.epoch, w.restarts, w.recent_restarts) for n, w in sim.status.worlds.items()}  # type: ignore[union-attr]
    sim.mw = suspended(sim.mw, True)
    result = sim.step()
    assert {d.pod for d in result.deletes} == {LEADER, W1_0, W1_1, W2_0, "mw-w1-spare-a", "mw-w1-spare-b"}
    assert all(d.reason.startswith(("the MultiWorld is suspended", "a warm spare beyond")) for d in result.deletes)
    assert result.creates == [] and result.table.worlds == []
    assert result.status.phase == "Suspended" and condition(result.status, "Suspended").status == "True"
    assert {n: w.phase for n, w in result.status.worlds.items()} == {"world1": "Suspended", "world2": "Suspended"}
    assert {n: (w.epoch, w.restarts, w.recent_restarts) for n, w in result.status.worlds.items()} == history
    assert sorted(reasons(sim)) == [("WorldSuspended", "world1"), ("WorldSuspended", "world2")]
    # Pods that go now are no failures, and nothing comes back while suspended.
    sim.advance(600)
    result = sim.step()
    assert result.actions == [] and result.status.restarts == history["world2"][1]

    sim.mw = suspended(sim.mw, False)
    result = sim.step()
    assert {n: (w.epoch, w.phase) for n, w in result.status.worlds.items()} == {
        "world1": (2, "Pending"),
        "world2": (3, "Pending"),
    }
    assert {c.pod: c.created_for for c in result.creates if not c.spare} == {
        LEADER: {"world1": 2, "world2": 3},
        W1_0: {"world1": 2},
        W1_1: {"world1": 2},
        W2_0: {"world2": 3},
    }
    assert condition(result.status, "Suspended").status == "False"
    assert sorted(reasons(sim)) == [("WorldResumed", "world1"), ("WorldResumed", "world2")]
    sim.settle()
    assert sim.status is not None and sim.status.phase == "Running"
    assert sim.status.worlds["world2"].restarts == history["world2"][1]  # the same budget goes on


def test_a_failed_world_stays_failed_through_suspend_and_resume() -> None:
    sim = running(failurePolicy={"maxRestarts": 0})
    sim.fail(W2_0)
    sim.step()
    sim.mw = suspended(sim.mw, True)
    sim.step()
    sim.mw = suspended(sim.mw, False)
    result = sim.step()
    assert result.status.worlds["world2"].phase == "Failed" and result.status.worlds["world1"].epoch == 2


# -- rollout of an edited template --------------------------------------------------------------

NEW_IMAGE = {"spec": {"containers": [{"name": "c", "image": "new"}]}}


def seed_with(strategy: dict[str, Any] | None = None, **member_templates: dict[str, Any]) -> MultiWorld:
    """The seed topology with the given members' templates and update strategy."""
    members: list[dict[str, Any]] = [{"name": "leader"}, {"name": "w1", "replicas": 2}, {"name": "w2"}]
    for member in members:
        if member["name"] in member_templates:
            member["template"] = member_templates[member["name"]]
    worlds = [{"name": "world1", "ranks": ["leader", "w1"]}, {"name": "world2", "ranks": ["leader", "w2"]}]
    spec: dict[str, Any] = {"updateStrategy": strategy} if strategy else {}
    return make(members, worlds, **spec)


def rolled(sim: Sim, rounds: int = 10) -> list[tuple[str, ...]]:
    """Step and start pods until nothing is left to do; the pods each step replaced."""
    batches = []
    for _ in range(rounds):
        result = sim.step()
        batches.append(tuple(sorted(d.pod for d in result.deletes)))
        sim.start_all()
    return [b for b in batches if b]


def test_a_template_edit_rolls_out_pod_by_pod_without_counting_restarts() -> None:
    sim = Sim(seed_with())
    sim.settle()
    sim.mw = seed_with(w1=NEW_IMAGE)
    result = sim.step()
    assert [(d.pod, d.reason) for d in result.deletes] == [(W1_0, "rolling out member w1's new template")]
    assert ("PodUpdated", None) in reasons(sim) and ("WorldUpdating", "world1") in reasons(sim)
    assert result.status.rollout == {"w1": "1/2"} and result.status.updated == "3/4"
    assert condition(result.status, "Progressing").reason == "RollingOut"
    assert sim.epoch("world1") == 2 and sim.epoch("world2") == 1
    assert rolled(sim) == [(W1_1,)]  # the second only once the first is back: maxUnavailable 1
    assert sim.status is not None and sim.status.restarts == 0 and sim.epoch("world1") == 3
    assert sim.status.updated == "4/4" and sim.status.rollout == {}
    assert condition(sim.status, "Progressing").reason == "RolloutComplete"
    assert sim.world_phase("world1") == "Running" and sim.world_phase("world2") == "Running"


def test_room_for_a_whole_world_moves_it_once() -> None:
    sim = Sim(seed_with({"maxUnavailable": 2}))
    sim.settle()
    sim.mw = seed_with({"maxUnavailable": 2}, w1=NEW_IMAGE)
    assert rolled(sim) == [(W1_0, W1_1)] and sim.epoch("world1") == 2


def test_a_paused_rollout_replaces_nothing_until_resumed() -> None:
    sim = Sim(seed_with())
    sim.settle()
    sim.mw = seed_with({"paused": True}, w2=NEW_IMAGE)
    result = sim.step()
    assert result.deletes == [] and condition(result.status, "Progressing").reason == "RolloutPaused"
    sim.mw = seed_with(w2=NEW_IMAGE)
    assert rolled(sim) == [(W2_0,)]


def test_a_shared_pods_new_template_moves_each_of_its_worlds_once() -> None:
    sim = Sim(seed_with())
    sim.settle()
    sim.mw = seed_with(leader=NEW_IMAGE)
    assert rolled(sim) == [(LEADER,)]
    assert (sim.epoch("world1"), sim.epoch("world2")) == (2, 2)


def test_a_failing_new_template_halts_its_rollout() -> None:
    sim = Sim(seed_with())
    sim.settle()
    sim.mw = seed_with(w1=NEW_IMAGE)
    sim.step()  # w1-0 goes
    sim.step()  # the new w1-0 is made
    sim.fail(W1_0)  # and crashes
    result = sim.step()
    assert ("RolloutHalted", None) in reasons(sim)
    progressing = condition(result.status, "Progressing")
    assert (
        progressing.reason == "RolloutHalted"
        and f"pod {W1_0} of member w1's new template failed" in progressing.message
    )
    assert result.status.worlds["world1"].restarts == 1  # the failure policy counts it
    for _ in range(6):
        sim.start_all()
        result = sim.step()
        assert W1_1 not in {d.pod for d in result.deletes}, "the halted rollout went on"
    assert sim.status is not None and sim.status.rollout == {"w1": "1/2"}
    sim.mw = seed_with(w1={"spec": {"containers": [{"name": "c", "image": "fixed"}]}})  # a new edit goes on
    assert W1_1 in {p for batch in rolled(sim) for p in batch}


def test_a_ready_spare_of_the_new_template_plays_the_rolled_pod() -> None:
    """w1 keeps one spare: the rollout waits for a warm spare of the new template, which plays
    the old pod; no pod of a w1 pod's name is made for it."""
    sim = with_spares(1)
    sim.mw = with_spares(1, template=NEW_IMAGE).mw
    assigns, creates = [], []
    for _ in range(12):
        result = sim.step()
        assigns += [(a.plays, a.pod) for a in result.assigns]
        creates += [c.pod for c in result.creates if not c.spare]
        sim.start_all()
    assert [plays for plays, _ in assigns] == [W1_0, W1_1], assigns
    assert creates == [], "a w1 pod was made although spares of the new template played"
    assert sim.status is not None and sim.status.updated == "4/4" and sim.status.spares == {"w1": "1/1"}


def two_spared_members(template: dict[str, Any] | None = None, **strategy: Any) -> MultiWorld:
    """A leader and members r1, r2 (one warm spare each), a world of each with the leader."""
    extra: dict[str, Any] = {"template": template} if template else {}
    members: list[dict[str, Any]] = [
        {"name": "leader"},
        {"name": "r1", "spares": 1, **extra},
        {"name": "r2", "spares": 1, **extra},
    ]
    worlds = [{"name": "world1", "ranks": ["leader", "r1"]}, {"name": "world2", "ranks": ["leader", "r2"]}]
    spec: dict[str, Any] = {"updateStrategy": strategy} if strategy else {}
    return make(members, worlds, **spec)


def spare_starts(sim: Sim, rounds: int = 16) -> list[tuple[list[str], list[str], str | None]]:
    """Step and start pods until nothing is left to do: per step, the members whose spares it
    created, the pods spares played, and the Progressing reason."""
    steps = []
    for _ in range(rounds):
        result = sim.step()
        progressing = result.status.condition("Progressing")
        steps.append(
            (
                [c.member for c in result.creates if c.spare],
                [a.plays for a in result.assigns],
                progressing.reason if progressing else None,
            )
        )
        sim.start_all()
    return steps


def test_a_rollout_starts_max_surge_spares_at_once_old_members_first_refills_included() -> None:
    """maxSurge 1 (the default): one spare of the new template starts at a time, each member with
    old pods before any refill; the rollout runs (Progressing RollingOut) until the pools are
    full again. maxSurge 2: both members' spares start at once."""
    sim = Sim(two_spared_members())
    sim.settle()
    sim.start_all()
    sim.step()
    assert sim.status is not None and sim.status.spares == {"r1": "1/1", "r2": "1/1"}
    sim.mw = two_spared_members(NEW_IMAGE)
    steps = spare_starts(sim)
    started = [member for created, _, _ in steps for member in created]
    played = [pod for _, plays, _ in steps for pod in plays]
    assert all(len(created) <= 1 for created, _, _ in steps), steps
    assert started == ["r1", "r2", "r1", "r2"] and played == ["mw-r1-0", "mw-r2-0"], steps
    last_start = max(i for i, (created, _, _) in enumerate(steps) if created)
    assert all(reason == "RollingOut" for _, _, reason in steps[: last_start + 1]), steps
    assert steps[-1][2] == "RolloutComplete" and sim.status.spares == {"r1": "1/1", "r2": "1/1"}

    sim = Sim(two_spared_members(maxSurge=2))
    sim.settle()
    sim.start_all()
    sim.step()
    sim.mw = two_spared_members(NEW_IMAGE, maxSurge=2)
    assert spare_starts(sim)[0][0] == ["r1", "r2"]


def test_a_spare_keeping_member_removed_while_a_rollout_refills_goes_with_its_spare() -> None:
    """The spares of a member the spec drops stay in the pool until that step deletes them:
    the rollout's count of spares must pass over them."""
    sim = Sim(two_spared_members())
    sim.settle()
    sim.start_all()
    sim.step()
    sim.mw = two_spared_members(NEW_IMAGE)
    for _ in range(16):  # until r2 has a spare of the new template (r1's came first)
        sim.step()
        assert sim.status is not None
        r2_spares = [name for name, spare in sim.status.spare_pool.items() if spare.member == "r2"]
        if r2_spares:
            break
        sim.start_all()
    assert sim.status is not None and condition(sim.status, "Progressing").reason == "RollingOut"
    members: list[dict[str, Any]] = [{"name": "leader"}, {"name": "r1", "spares": 1, "template": NEW_IMAGE}]
    sim.mw = make(members, [{"name": "world1", "ranks": ["leader", "r1"]}])
    result = sim.step()
    assert set(r2_spares) <= {d.pod for d in result.deletes}, result.deletes
    assert set(result.status.spares) == {"r1"}


def test_a_pod_that_finishes_after_its_world_ran_at_the_epoch_is_not_replaced() -> None:
    """A finished program leaves its worlds before it exits (its worker shows none joined): in a
    world that ran at its current epoch, that is an end, not a program that left a broken world."""
    sim = running()
    sim.fail(W1_1)
    sim.settle()
    assert sim.world_phase("world1") == "Running" and sim.epoch("world1") == 2
    sim.pods[LEADER] = sim.pods[LEADER].model_copy(update={"phase": "Succeeded", "joined": {}})
    result = sim.step()
    assert result.deletes == [] and sim.epoch("world1") == 2 and sim.epoch("world2") == 1


# -- when a world formed ------------------------------------------------------------------------


def test_a_world_formed_when_its_last_rank_joined_by_the_workers_clocks() -> None:
    """formedAt: the latest of its ranks' joined_at at the epoch it runs at; None while one did
    not say, and again once the world fails."""
    sim = Sim(seed_topology())
    sim.step()
    sim.start_all()
    joined = {LEADER: 3.0, W1_0: 1.0, W1_1: 2.0, W2_0: 5.0}
    for pod, seconds in joined.items():
        stamp = T0 + timedelta(seconds=seconds)
        sim.pods[pod] = sim.pods[pod].model_copy(update={"joined_at": {"world1": stamp, "world2": stamp}})
    sim.pods[W2_0] = sim.pods[W2_0].model_copy(update={"joined_at": {}})  # this worker says nothing
    sim.step()
    assert sim.status is not None
    world1, world2 = sim.status.worlds["world1"], sim.status.worlds["world2"]
    assert (world1.phase, world1.formed_at) == ("Running", T0 + timedelta(seconds=3))
    assert (world2.phase, world2.formed_at) == ("Running", None)
    assert sim.status.view()["worlds"]["world1"]["formedAt"] == "2024-05-01T12:00:03Z"
    # A worker that says so after its Running pod counted ready: the world's formedAt follows.
    late = T0 + timedelta(seconds=7)
    sim.pods[W2_0] = sim.pods[W2_0].model_copy(update={"joined_at": {"world2": late}})
    sim.step()
    assert sim.status is not None and sim.status.worlds["world2"].formed_at == late
    sim.fail(W1_1)
    sim.step()
    assert sim.status.worlds["world1"].phase != "Running" and sim.status.worlds["world1"].formed_at is None
