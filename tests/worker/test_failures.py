"""Failures in one world never disturb another world of the same processes.

Real processes, gloo over loopback. Detection latencies are printed (pytest -s), and only
bounded generously: these machines are busy.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.worker_support import BACKENDS, TEST_DETECT, assignment, free_ports, static_env, table

DETECTED_WITHIN = 10.0


def progressed(member, world: str, beyond: int, timeout: float = 60) -> int:
    """Wait for a progress event of `world` with more than `beyond` steps; return its count."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [e["steps"] for e in member.named("progress") if e["world"] == world]
        if steps and steps[-1] > beyond:
            return steps[-1]
        time.sleep(0.1)
    raise AssertionError(f"{world} made no progress beyond {beyond} steps:\n{member.stderr()}")


def steps_of(member, world: str) -> int:
    return max((e["steps"] for e in member.named("progress") if e["world"] == world), default=0)


def stop_all(*members) -> list[dict]:
    for member in members:
        member.tell("stop")
    summaries = [member.wait_for("summary") for member in members]
    for member in members:
        assert member.wait_exit() == 0, member.stderr()
    return summaries


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_in_busy_world_then_rejoin_at_new_epoch(spawn, table_server, backend: str) -> None:
    """Leader L in w1 (with a) and w2 (with b), both stepping. a is SIGKILLed: L sees w1 break,
    reports it over the local channel, rejoins w1 at epoch 2 with a respawned a, and w2 sees
    no error at all. Then w2 is removed from the table: L leaves it."""
    p1, p2 = free_ports(2)
    table_server.publish(table(1, ("w1", 1, p1, ["L", "a"]), ("w2", 1, p2, ["L", "b"]), backend=backend))
    args = {"detect": TEST_DETECT, "rejoin": True, "backend": backend}

    def world(name: str, rank: int, port: int, epoch: int = 1) -> dict:
        return assignment(name, rank, 2, port, epoch=epoch, backend=backend)

    leader = spawn(
        "steady",
        {**args, "worlds": {"w1": "busy", "w2": "busy"}},
        table_server.env("L", [world("w1", 0, p1), world("w2", 0, p2)]),
    )
    a = spawn("steady", {**args, "worlds": {"w1": "busy"}}, table_server.env("a", [world("w1", 1, p1)]))
    b = spawn("steady", {**args, "worlds": {"w2": "busy"}}, table_server.env("b", [world("w2", 1, p2)]))
    progressed(leader, "w1", 5)
    progressed(leader, "w2", 5)

    killed_at = time.time()
    a.signal(signal.SIGKILL)
    broken = leader.wait_for("broken", world="w1")
    latency = broken["at"] - killed_at
    print(f"\nbusy world, peer SIGKILLed: detected after {latency * 1000:.0f} ms ({broken['reason']})")
    assert latency < DETECTED_WITHIN
    assert broken["epoch"] == 1
    table_server.wait_until(
        lambda: any(r.world == "w1" and r.epoch == 1 and r.pod == "L" for r in table_server.reports),
        "L reports w1 epoch 1 broken",
    )
    w2_at_failure = progressed(leader, "w2", steps_of(leader, "w2"))

    table_server.publish(table(2, ("w1", 2, p1, ["L", "a"]), ("w2", 1, p2, ["L", "b"]), backend=backend))
    a2 = spawn("steady", {**args, "worlds": {"w1": "busy"}}, table_server.env("a", [world("w1", 1, p1, epoch=2)]))
    assert leader.wait_for("rejoined", world="w1")["epoch"] == 2
    progressed(leader, "w1", steps_of(leader, "w1"))
    table_server.wait_until(
        lambda: any(s.pod == "L" and s.joined == {"w1": 2, "w2": 1} for s in table_server.statuses),
        "L's status shows w1 at epoch 2 and w2 at epoch 1",
    )
    assert progressed(leader, "w2", w2_at_failure) > w2_at_failure
    assert not b.named("broken"), "w2 saw an error"
    assert [e["world"] for e in leader.named("broken")] == ["w1"]

    # w2 leaves the table: both members leave it (one may learn it from the other's verdict
    # first), and as nothing failed, nobody reports it.
    table_server.publish(table(3, ("w1", 2, p1, ["L", "a"]), backend=backend))
    left = b.wait_for("broken", world="w2")
    assert left["reason"] in ("rank 1 left the world", "rank 0 left the world (verdict of rank 0)"), left
    table_server.wait_until(
        lambda: any(s.pod == "L" and s.joined == {"w1": 2} for s in table_server.statuses),
        "L's status without w2",
    )
    assert not [r for r in table_server.reports if r.world == "w2"], table_server.reports
    summaries = stop_all(leader, a2)
    assert summaries[0]["errors"]["w1"] == 1
    assert summaries[0]["wrong"] == {"w1": 0, "w2": 0}
    assert summaries[1]["errors"] == {"w1": 0}


def test_frozen_store_host_and_killed_idle_peer(spawn) -> None:
    """L is in three worlds: w1 (busy) whose rank 0 (the store host) is SIGSTOPped, w2 (busy)
    that stays healthy, w3 (idle, no ops) whose peer is SIGKILLed. Only w1 and w3 break."""
    p1, p2, p3 = free_ports(3)
    args = {"detect": TEST_DETECT}
    leader = spawn(
        "steady",
        {**args, "worlds": {"w1": "busy", "w2": "busy", "w3": "idle"}},
        static_env("L", [assignment("w1", 1, 2, p1), assignment("w2", 0, 2, p2), assignment("w3", 0, 2, p3)]),
    )
    host = spawn("steady", {**args, "worlds": {"w1": "busy"}}, static_env("a", [assignment("w1", 0, 2, p1)]))
    b = spawn("steady", {**args, "worlds": {"w2": "busy"}}, static_env("b", [assignment("w2", 1, 2, p2)]))
    c = spawn("steady", {**args, "worlds": {"w3": "idle"}}, static_env("c", [assignment("w3", 1, 2, p3)]))
    progressed(leader, "w1", 5)
    progressed(leader, "w2", 5)
    c.wait_for("joined")

    failed_at = time.time()
    host.signal(signal.SIGSTOP)
    c.signal(signal.SIGKILL)
    frozen = leader.wait_for("broken", world="w1")
    idle = leader.wait_for("broken", world="w3")
    for what, event in (("busy world, store host SIGSTOPped", frozen), ("idle world, peer SIGKILLed", idle)):
        print(f"\n{what}: detected after {(event['at'] - failed_at) * 1000:.0f} ms ({event['reason']})")
        assert event["at"] - failed_at < DETECTED_WITHIN
        assert event["peer_rank"] == 0 if event is frozen else event["peer_rank"] == 1
    assert "store" in frozen["reason"]
    assert "heartbeat" in idle["reason"]

    after = steps_of(leader, "w2")
    assert progressed(leader, "w2", after) > after
    summaries = stop_all(leader, b)
    assert summaries[0]["errors"] == {"w1": 1, "w2": 0, "w3": 1}
    assert summaries[0]["wrong"]["w2"] == 0
    assert summaries[1]["errors"] == {"w2": 0}
    host.signal(signal.SIGCONT)


def test_old_epoch_is_fenced_out(spawn) -> None:
    """World w runs at epoch 2. A member of epoch 1 cannot join (nor take the store's port), a
    second rank 1 of epoch 2 is refused, and w keeps stepping; a member arriving for epoch 3
    retires epoch 2 on both members."""
    (port,) = free_ports(1)
    args = {"detect": TEST_DETECT}
    first = spawn("steady", {**args, "worlds": {"w": "busy"}}, static_env("A", [assignment("w", 0, 2, port, epoch=2)]))
    second = spawn("steady", {**args, "worlds": {"w": "busy"}}, static_env("B", [assignment("w", 1, 2, port, epoch=2)]))
    progressed(first, "w", 5)

    stale = spawn("join", {**args, "world": assignment("w", 1, 2, port, epoch=1)})
    refused = stale.wait_for("join_error")
    assert refused["type"] == "StaleEpochError" and "epoch 2" in refused["message"]
    assert refused["seconds"] < DETECTED_WITHIN

    stale_host = spawn("join", {**args, "world": assignment("w", 0, 2, port, epoch=1)})
    assert "cannot serve" in stale_host.wait_for("join_error")["message"]

    duplicate = spawn("join", {**args, "world": assignment("w", 1, 2, port, epoch=2)})
    assert "already taken" in duplicate.wait_for("join_error")["message"]

    progressed(first, "w", steps_of(first, "w"))
    assert not first.named("broken") and not second.named("broken")

    newer = spawn("join", {**args, "world": assignment("w", 1, 2, port, epoch=3)})
    reasons = [member.wait_for("broken", world="w")["reason"] for member in (first, second)]
    newer.kill()
    # Each member reads the newer epoch from the store; one that is slower may see its peer
    # release the communicator first.
    assert "superseded by epoch 3" in reasons, reasons
    assert all(r == "superseded by epoch 3" or r.startswith("all_reduce failed") for r in reasons), reasons
    summaries = stop_all(first, second)
    assert [s["wrong"] for s in summaries] == [{"w": 0}, {"w": 0}]


def test_a_member_gone_while_the_communicator_is_built_fails_the_join_naming_it(spawn) -> None:
    """Rank 1 takes part in the handshake, then dies before the communicator is built: rank 0,
    whose build waits for every member, fails its join naming rank 1 and its pod, instead of
    waiting out the op timeout (60 s here) with a timeout that names nobody."""
    (port,) = free_ports(1)
    args = {"detect": TEST_DETECT}
    rank0 = spawn("join", {**args, "pod": "A", "world": assignment("w", 0, 2, port)})
    gone = spawn("gone_before_build", {"pod": "B", "world": assignment("w", 1, 2, port)})
    gone.wait_for("handshake_done")
    failed = rank0.wait_for("join_error")
    assert "rank 1 (pod B)" in failed["message"] and "being built" in failed["message"], failed
    assert rank0.wait_exit() == 0


def test_members_told_different_sizes_are_refused(spawn) -> None:
    (port,) = free_ports(1)
    args = {"detect": TEST_DETECT}
    members = [
        spawn("join", {**args, "world": assignment("w", 0, 2, port)}),
        spawn("join", {**args, "world": assignment("w", 1, 3, port)}),
    ]
    for member in members:
        message = member.wait_for("join_error")["message"]
        assert "size mismatch" in message and "rank 0" in message, message
        assert member.wait_exit() == 0


def test_exit_is_fast_with_a_frozen_peer(spawn) -> None:
    """Op timeout 60 s; a process whose peer is SIGSTOPped still exits in a few seconds, both
    after the verdict and with an op still stuck on the frozen peer, with the status it asked
    for."""
    for wait_for_verdict, status in ((True, 0), (False, 3)):
        (port,) = free_ports(1)
        args = {"detect": TEST_DETECT, "wait_for_verdict": wait_for_verdict, "exit_status": status}
        leader = spawn("frozen_exit", {**args, "pod": "L", "world": assignment("w", 0, 2, port)})
        peer = spawn("frozen_exit", {**args, "pod": "P", "world": assignment("w", 1, 2, port)})
        leader.wait_for("joined")
        peer.wait_for("joined")
        peer.signal(signal.SIGSTOP)
        leader.tell("go")
        exiting = leader.wait_for("exiting")
        assert leader.wait_exit(timeout=30) == status, leader.stderr()
        took = time.time() - exiting["at"]
        print(f"\nexit with a frozen peer (verdict first: {wait_for_verdict}): {took:.2f} s")
        assert took < DETECTED_WITHIN, leader.stderr()
        if wait_for_verdict:
            assert "rank 1 sent no heartbeat" in leader.named("broken")[0]["reason"]
        peer.kill()


def test_a_blocking_recv_waits_as_long_as_its_peer_lives_and_ends_when_it_freezes(spawn) -> None:
    """The caller's own thread waits on a gloo recv: a silent but healthy peer is waited for
    (longer than dead_after), a send is received, and a frozen peer's verdict frees the wait."""
    (port,) = free_ports(1)
    args = {"detect": TEST_DETECT}
    receiver = spawn("blocked_recv", {**args, "pod": "R", "world": assignment("w", 0, 2, port)})
    sender = spawn("blocked_recv", {**args, "pod": "S", "world": assignment("w", 1, 2, port)})
    receiver.wait_for("waiting")
    time.sleep(TEST_DETECT["dead_after"] * 1.5)
    assert not receiver.named("broken") and not receiver.named("received")
    sender.tell("send")
    assert receiver.wait_for("received")["value"] == [1.0] * 4

    frozen_at = time.time()
    sender.signal(signal.SIGSTOP)
    broken = receiver.wait_for("broken")
    print(f"\nblocking recv, peer SIGSTOPped: freed after {(broken['at'] - frozen_at) * 1000:.0f} ms")
    assert broken["at"] - frozen_at < DETECTED_WITHIN
    assert "heartbeat" in broken["reason"] and broken["peer_rank"] == 1, broken
    assert receiver.wait_exit() == 0, receiver.stderr()
    sender.kill()


@pytest.mark.parametrize(("op", "action"), [("all_reduce", "freeze"), ("all_reduce", "leave"), ("recv", "leave")])
def test_a_blocked_op_is_freed_by_a_frozen_peer_and_by_a_deliberate_leave(spawn, op: str, action: str) -> None:
    """Ranks 0 and 1 of three are blocked: in an all_reduce that rank 2 never joins, or each in
    a recv from the other. When rank 2 freezes, both are freed with the heartbeat's verdict.
    When instead rank 0 leaves the world from another thread, its own blocked caller is freed,
    and rank 1 learns that rank 0 left (the verdict, not a closed connection): a deliberate
    leave never looks like a failure."""
    (port,) = free_ports(1)
    args = {"detect": TEST_DETECT, "op": op}
    members = [
        spawn("blocked_op", {**args, "pod": f"m{rank}", "world": assignment("w", rank, 3, port)}) for rank in range(3)
    ]
    blocked, idle = members[:2], members[2]
    for member in blocked:
        member.wait_for("waiting")
    idle.wait_for("joined")
    time.sleep(TEST_DETECT["dead_after"] * 1.5)
    assert not any(m.named("broken") or m.named("completed") for m in blocked), "an op ended early"

    acted_at = time.time()
    if action == "freeze":
        idle.signal(signal.SIGSTOP)
    else:
        blocked[0].tell("leave")
    freed = [m.wait_for("broken") for m in blocked]
    took = max(e["at"] for e in freed) - acted_at
    print(f"\n{op} blocked on 2 of 3 ranks, {action}: both callers freed after {took * 1000:.0f} ms")
    assert took < DETECTED_WITHIN
    if action == "freeze":
        for event in freed:
            assert "rank 2 sent no heartbeat" in event["reason"] and event["peer_rank"] == 2, event
        idle.kill()
        for member in blocked:
            member.tell("leave")
            assert member.wait_exit() == 0, member.stderr()
    else:
        assert freed[0]["reason"] == "rank 0 left the world", freed[0]
        assert freed[1]["reason"] == "rank 0 left the world (verdict of rank 0)", freed[1]
        for member in (blocked[1], idle):
            member.tell("leave")
        for member in members:
            assert member.wait_exit() == 0, member.stderr()
