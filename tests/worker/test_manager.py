"""The manager's side of the contract, with both members of a world in this one process (two
managers, gloo over loopback, each with its own local channel to the runner's real server)."""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch.distributed import TCPStore

import multiworld as mw
from multiworld.channels import open_channel
from multiworld_operator.local.runner import LocalRunner
from multiworld_operator.spec import load_manifest
from tests.support.worker_support import free_ports, table

FAST = mw.DetectConfig(heartbeat_interval=0.05, dead_after=1.5, join_timeout=30, op_timeout=30)


def managers(table_server, *pods: str) -> list[mw.WorldManager]:
    return [mw.WorldManager(pod=pod, config=FAST, channel=open_channel(table_server.url, pod)) for pod in pods]


def started(work: mw.Work | None) -> mw.Work:
    """What an op called with async_op=True returns."""
    assert work is not None
    return work


async def all_reduce_pair(first: mw.World, second: mw.World) -> list[float]:
    tensors = [torch.full((2,), float(w.rank + 1)) for w in (first, second)]
    works = [started(w.all_reduce(t, async_op=True)) for w, t in zip((first, second), tensors, strict=True)]
    await asyncio.gather(*works)
    return tensors[0].tolist() + tensors[1].tolist()


def test_apply_follows_the_table(table_server) -> None:
    (port,) = free_ports(1)
    table_server.publish(table(1, ("w", 1, port, ["p0", "p1"])))
    m0, m1 = managers(table_server, "p0", "p1")

    async def scenario() -> None:
        first = [await m.wait_world("w", timeout=60) for m in (m0, m1)]
        assert [w.epoch for w in first] == [1, 1] and [w.rank for w in first] == [0, 1]
        assert await all_reduce_pair(*first) == [3.0] * 4

        table_server.publish(table(2, ("w", 2, port, ["p0", "p1"])))
        second = [await m.wait_world("w", newer_than=1, timeout=60) for m in (m0, m1)]
        assert [w.epoch for w in second] == [2, 2]
        assert first[0].broken and first[0].error is not None
        assert first[0].error.reason == "rank 0 moved on to epoch 2"
        assert await all_reduce_pair(*second) == [3.0] * 4
        table_server.wait_until(
            lambda: any(s.pod == "p1" and s.joined == {"w": 2} for s in table_server.statuses), "p1 at epoch 2"
        )

        table_server.publish(table(3))
        deadline = time.monotonic() + 60
        while (m0.worlds() or m1.worlds()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert m0.worlds() == {} and m1.worlds() == {}
        assert second[1].error is not None and "left the world" in second[1].error.reason
        assert m0.status().errors == {} and m1.status().errors == {}

    asyncio.run(scenario())
    # An older revision changes nothing.
    m0.apply(table(2, ("w", 2, port, ["p0", "p1"])))
    with pytest.raises(mw.UnknownWorldError, match="holds no world"):
        m0.world("w")
    assert not table_server.reports
    for m in (m0, m1):
        m.close()


def test_a_replaced_instance_never_takes_its_pods_rank_again(table_server) -> None:
    """A process whose pod the table gives to a newer instance joins nothing more, so the new
    instance finds its rank free; the newer instance itself follows the table."""
    (port,) = free_ports(1)
    old = mw.WorldManager(pod="p1", config=FAST, instance={"w": 1})
    new = mw.WorldManager(pod="p1", config=FAST, instance={"w": 2})
    epoch2 = table(2, ("w", 2, port, ["p0", "p1"]))
    epoch2.worlds[0].instances.update({"p0": 1, "p1": 2})
    try:
        old.apply(epoch2)
        assert old.status().joining == {} and old.worlds() == {}
        new.apply(epoch2)
        assert set(new.status().joining) == {"w"}
    finally:
        old.close()
        new.close()


def test_an_environment_epoch_older_than_the_table_is_left_out(table_server) -> None:
    """At start-up the live table can arrive before the environment's worlds are joined and
    already carry a newer epoch: init_from_env leaves the older assignment out (a plain join of
    it is refused) and waits for the table's join instead of dying."""
    (port,) = free_ports(1)
    table_server.publish(table(1, ("w", 2, port, ["p0", "p1"])))
    m0, m1 = managers(table_server, "p0", "p1")
    try:
        assert [m.wait_world_blocking("w", timeout=60).epoch for m in (m0, m1)] == [2, 2]
        from_env = mw.WorldAssignment(name="w", rank=0, size=2, host="127.0.0.1", port=port, epoch=1)
        with pytest.raises(mw.StaleEpochError):
            m0.join(from_env)
        (join,) = m0.start_joins([from_env], newest_only=True)
        assert join.result() is m0.world("w") and join.result().epoch == 2
    finally:
        m0.close()
        m1.close()


def test_following_a_table_a_timed_out_join_goes_on_waiting(table_server) -> None:
    """A peer slow to start (its pod still scheduling): the member reports the timed-out join
    and keeps waiting at the same epoch, so the world forms when the peer comes."""
    (port,) = free_ports(1)
    table_server.publish(table(1, ("w", 1, port, ["p0", "p1"])))
    patient = mw.DetectConfig(heartbeat_interval=0.05, dead_after=1.5, join_timeout=1, op_timeout=30)
    first = mw.WorldManager(pod="p0", config=patient, channel=open_channel(table_server.url, "p0"))
    late = None
    try:
        table_server.wait_until(
            lambda: any(r.world == "w" and r.reason.startswith("join failed: ") for r in table_server.reports),
            "a timed-out join reported",
        )
        time.sleep(1.5)  # another timeout or two pass: still waiting, at the same epoch
        assert first.worlds() == {} and set(first.status().joining) == {"w"}
        late = mw.WorldManager(pod="p1", config=FAST, channel=open_channel(table_server.url, "p1"))
        worlds = [m.wait_world_blocking("w", timeout=60) for m in (first, late)]
        assert [w.epoch for w in worlds] == [1, 1]
    finally:
        first.close()
        if late is not None:
            late.close()


STALE_STORE = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), None, True, timedelta(seconds=30), wait_for_workers=False)
print("serving", flush=True)
time.sleep(3600)
"""


def test_following_a_table_a_join_whose_store_went_away_is_tried_again(table_server) -> None:
    """The store at the table's address belongs to a process about to end (on Kubernetes: the
    replaced instance of the rank-0 pod, its name still resolving to its old address, its
    process still up for a moment): the member reaches it, then loses it. It tries the same
    epoch again and joins once the new rank 0 serves there; it used to give that epoch up for
    good, and nothing else would ever have asked it to join (the world waited for it until the
    platform's join timeout replaced it). It reports nothing: the new instance may run already,
    and the platform counted such a report as the epoch failing (a rollout's restart)."""
    (port,) = free_ports(1)
    stale = subprocess.Popen([sys.executable, "-c", STALE_STORE, str(port)], stdout=subprocess.PIPE, text=True)
    member = rank0 = None
    try:
        assert stale.stdout is not None and stale.stdout.readline().strip() == "serving"
        table_server.publish(table(1, ("w", 2, port, ["p0", "p1"])))
        (member,) = managers(table_server, "p1")
        probe = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
        deadline = time.monotonic() + 60
        while not probe.check(["w/epoch"]):  # the member's rendezvous is under way there
            assert time.monotonic() < deadline, "the member never reached the store"
            time.sleep(0.05)
        del probe
        stale.kill()
        stale.wait()
        (rank0,) = managers(table_server, "p0")
        worlds = [m.wait_world_blocking("w", timeout=60) for m in (rank0, member)]
        assert [w.epoch for w in worlds] == [2, 2]
        assert not table_server.reports, table_server.reports
    finally:
        stale.kill()
        for manager in (member, rank0):
            if manager is not None:
                manager.close()


def test_a_store_lost_at_every_try_ends_in_a_reported_timeout_at_the_first_tries_deadline(table_server) -> None:
    """A store that accepts and at once drops every connection (the member loses it at each
    try): the tries again share the first one's deadline, so the join times out and says so
    once the join timeout is over, rather than trying unheard for ever."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    dropping = True

    def drop() -> None:
        while dropping:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connection.close()

    dropper = threading.Thread(target=drop, daemon=True)
    dropper.start()
    table_server.publish(table(1, ("w", 1, port, ["p0", "p1"])))
    config = FAST.model_copy(update={"join_timeout": 3.0})
    member = mw.WorldManager(pod="p1", config=config, channel=open_channel(table_server.url, "p1"))
    try:
        started = time.monotonic()
        table_server.wait_until(lambda: bool(table_server.reports), "the timed-out join reported", timeout=30)
        waited = time.monotonic() - started
        (report,) = table_server.reports
        assert report.world == "w" and report.epoch == 1, report
        # The timeout's words, not the lost store's (which add the store client's error).
        assert report.reason == f"join failed: cannot reach the store of world 'w' at 127.0.0.1:{port}", report
        assert 2.9 <= waited < 3.0 + 5.0, f"reported {waited:.1f}s after the join began"
    finally:
        dropping = False
        listener.close()
        member.close()


def _port_free(port: int) -> bool:
    """Nothing listens on `port` (connections of a closed server may linger in TIME_WAIT)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


@pytest.mark.parametrize("ending", ["timed out", "called off"])
def test_a_failed_rank0_join_stops_the_store_it_started(ending: str) -> None:
    (port,) = free_ports(1)
    config = mw.DetectConfig(
        heartbeat_interval=0.05, dead_after=1.5, join_timeout=60 if ending == "called off" else 1, op_timeout=30
    )
    manager = mw.WorldManager(pod="p0", config=config)
    try:
        (join,) = manager.start_joins([mw.WorldAssignment(name="w", rank=0, size=2, host="127.0.0.1", port=port)])
        deadline = time.monotonic() + 30
        while _port_free(port) and time.monotonic() < deadline:  # the store serves: its peer never comes
            time.sleep(0.05)
        assert not _port_free(port)
        if ending == "called off":
            manager.leave("w")
        assert join.done.wait(60) and join.error is not None
        assert _port_free(port), "the store server outlived its join"
    finally:
        manager.close()


# Linux 6.3+: a socket's own range of ephemeral ports (only where it lies inside the kernel's).
IP_LOCAL_PORT_RANGE = 51


def _bound_by_the_kernel(port: int) -> socket.socket:
    """A listener on a port the kernel picks (port 0), as gloo's or any program's on this
    machine, steered to `port` wherever the kernel may hand that one out."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.IPPROTO_IP, IP_LOCAL_PORT_RANGE, struct.pack("=I", port << 16 | port))
    except OSError:
        sock.close()
        pytest.skip("no IP_LOCAL_PORT_RANGE (Linux 6.3+) to steer the kernel's choice of port")
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_the_runners_store_port_is_no_port_the_kernel_hands_out(tmp_path: Path) -> None:
    """`multiworld run` picks each world's store port at start; rank 0 serves it only from its
    first join on, and again at each epoch after a join that failed. Were it a port the kernel
    hands out (an ephemeral one, as binding port 0 picks), any socket of the machine could get
    it meanwhile, and rank 0 would fail every epoch with EADDRINUSE for as long as that socket
    lived. Here such a socket exists from the start; rank 0's first join fails (its peer never
    comes) and the next epochs serve the store on the same port."""
    example = Path(__file__).resolve().parents[2] / "examples" / "all_gather" / "multiworld.yaml"
    runner = LocalRunner(load_manifest(example), manifest_dir=example.parent, kills=[], log_dir=tmp_path)
    port = runner.ports["world2"]
    impatient = mw.DetectConfig(heartbeat_interval=0.05, dead_after=1.5, join_timeout=1, op_timeout=30)

    def assigned(rank: int, epoch: int) -> mw.WorldAssignment:
        return mw.WorldAssignment(name="world2", rank=rank, size=2, host="127.0.0.1", port=port, epoch=epoch)

    stray = _bound_by_the_kernel(port)
    leader, peer = mw.WorldManager(pod="leader", config=FAST), mw.WorldManager(pod="w2", config=FAST)
    try:
        with pytest.raises(mw.JoinTimedOut):
            leader.join(assigned(0, 1), config=impatient)
        for epoch in (2, 3):
            joins = [join for rank, m in enumerate((leader, peer)) for join in m.start_joins([assigned(rank, epoch)])]
            assert all(join.done.wait(60) for join in joins)
            worlds = [join.result() for join in joins]
            assert asyncio.run(all_reduce_pair(*worlds)) == [3.0] * 4
    finally:
        stray.close()
        leader.close()
        peer.close()


def test_a_peer_leaving_breaks_the_world_and_its_name_is_used_again(table_server) -> None:
    """p1 leaves on purpose: p0's pending and new ops raise, naming rank 1; nothing failed, so
    nothing is reported or counted. Then both join the same world name at epoch 2 (p0 still
    serves its store) and it works."""
    (port,) = free_ports(1)
    m0, m1 = managers(table_server, "p0", "p1")

    def at(epoch: int, rank: int) -> mw.WorldAssignment:
        return mw.WorldAssignment(name="w", rank=rank, size=2, host="127.0.0.1", port=port, epoch=epoch)

    async def scenario() -> None:
        w0, w1 = await asyncio.gather(m0.join_async(at(1, 0)), m1.join_async(at(1, 1)))
        pending = started(w0.all_reduce(torch.ones(1), async_op=True))
        m1.leave("w")
        with pytest.raises(mw.WorldBrokenError) as broken:
            await pending
        assert (broken.value.world, broken.value.epoch, broken.value.peer_rank) == ("w", 1, 1)
        assert broken.value.reason == "rank 1 left the world (verdict of rank 1)"
        with pytest.raises(mw.WorldBrokenError):
            w0.barrier()
        assert m0.world("w") is w0 and w0.broken
        assert m0.status().errors == {} and m0.status().joined == {}

        with pytest.raises(mw.WorldJoinError, match="is broken"):
            m0.join(at(1, 0))
        v0, v1 = await asyncio.gather(m0.join_async(at(2, 0)), m1.join_async(at(2, 1)))
        assert await all_reduce_pair(v0, v1) == [3.0] * 4
        assert m0.status().joined == {"w": 2}
        assert w0.wait_released(30)

    asyncio.run(scenario())
    for m in (m0, m1):
        m.close()
    assert not table_server.reports


def test_join_refusals_and_waits(table_server) -> None:
    (port,) = free_ports(1)
    quick = mw.DetectConfig(join_timeout=1.0)
    (manager,) = [mw.WorldManager(pod="p0", config=quick, channel=open_channel(table_server.url, "p0"))]
    with pytest.raises(mw.UnknownWorldError) as unknown:
        manager.world("nope")
    assert isinstance(unknown.value, KeyError) and isinstance(unknown.value, ValueError)
    assert str(unknown.value) == "unknown world 'nope': this process holds no world"
    with pytest.raises(ValidationError, match="rank 5 is out of range for size 2"):
        manager.join({"name": "w", "rank": 5, "size": 2, "host": "127.0.0.1", "port": port})
    with pytest.raises(ValidationError, match="must be a DNS label"):
        manager.join({"name": "World_1", "rank": 0, "size": 2, "host": "127.0.0.1", "port": port})

    started = time.monotonic()
    with pytest.raises(mw.WorldJoinError, match="cannot reach the store of world 'lonely'"):
        manager.join(mw.WorldAssignment(name="lonely", rank=1, size=2, host="127.0.0.1", port=port))
    assert time.monotonic() - started < 30
    table_server.wait_until(
        lambda: any(r.world == "lonely" and r.reason.startswith("join failed") for r in table_server.reports),
        "the failed join reported",
    )
    # A rendezvous that times out frees its rank: the same epoch can be joined afterwards.
    alone = mw.WorldAssignment(name="pair", rank=0, size=2, host="127.0.0.1", port=port)
    with pytest.raises(mw.WorldJoinError, match="timed out waiting for rank"):
        manager.join(alone)
    partner = mw.WorldManager(pod="p1", config=FAST)

    async def together() -> tuple[mw.World, mw.World]:
        return await asyncio.gather(manager.join_async(alone), partner.join_async(alone.model_copy(update={"rank": 1})))

    assert [w.rank for w in asyncio.run(together())] == [0, 1]
    partner.close()
    if not torch.cuda.is_available():
        with pytest.raises(mw.WorldJoinError, match="backend nccl needs a CUDA device"):
            manager.join(mw.WorldAssignment(name="gpu", rank=0, size=2, host="127.0.0.1", port=port, backend="nccl"))
    with pytest.raises(TimeoutError, match="world 'w'"):
        manager.wait_world_blocking("w", timeout=0.2)
    with pytest.raises(TimeoutError, match="world 'w'"):
        asyncio.run(manager.wait_world("w", newer_than=3, timeout=0.2))
    manager.close()
    with pytest.raises(RuntimeError, match="closed"):
        manager.join(mw.WorldAssignment(name="w", rank=0, size=2, host="127.0.0.1", port=port))
