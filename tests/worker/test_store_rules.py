"""The stores this library serves (multiworld.store): torch's own client gets from them what it
gets from torch's server, and a client that is not ours (raw sockets, tests.support.raw_store)
gets no list of keys, no write the store's rules refuse, and no more connections, bytes or time
than its bounds allow (docs/security.md, "Each world's rendezvous store"). Every 127/8 address
but 127.0.0.1 is a source of its own."""

from __future__ import annotations

import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.distributed import TCPStore

from multiworld.store import server as store_server
from multiworld.store.key_values import MAX_HELD_BYTES_PER_SOURCE
from multiworld.store.protocol import MAX_KEY_BYTES, MAX_VALUE_BYTES
from multiworld.store.rules import BEAT_STORE, WORLD_STORE, KeyRules
from multiworld.store.server import LOOPBACK, MAX_CONNECTIONS_PER_SOURCE, StoreServer
from tests.support import raw_store
from tests.support.bench_common import status_field

pytestmark = pytest.mark.quick

STRANGER = "127.0.0.2"
OTHER = "127.0.0.3"
CLOSED_WITHIN_S = 3.0


def client(port: int, timeout: float = 5.0) -> Any:
    return TCPStore(LOOPBACK, port, None, False, timedelta(seconds=timeout))


def raw(port: int, source: str = STRANGER) -> socket.socket:
    sock = socket.create_connection((LOOPBACK, port), timeout=CLOSED_WITHIN_S, source_address=(source, 0))
    sock.sendall(raw_store.hello())
    return sock


def closed(sock: socket.socket) -> bool:
    """Whether the store closes `sock` (reads whatever it still says first)."""
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def served(rules: KeyRules) -> Iterator[StoreServer]:
    server = store_server.serve(LOOPBACK, 0, rules)
    yield server
    server.close()


@pytest.fixture
def world_store() -> Iterator[StoreServer]:
    yield from served(WORLD_STORE)


@pytest.fixture
def beat_store() -> Iterator[StoreServer]:
    yield from served(BEAT_STORE)


@pytest.fixture(scope="module")
def both_clients() -> Iterator[tuple[Any, Any]]:
    """A client of torch's server and one of ours, kept: torch's server looks each new
    connection up in DNS, which may take the resolver's whole timeout (store/server.py)."""
    torchs = TCPStore(LOOPBACK, 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    ours = store_server.serve(LOOPBACK, 0, WORLD_STORE)
    yield client(torchs.port, 30.0), client(ours.port)
    ours.close()


def script(store: Any, other: Any) -> list[object]:
    """What torch's client is answered, for each call a world's members and gloo make."""
    said: list[object] = []
    store.set("a", "1")
    said.append(store.get("a"))
    said += [store.add("n", 5), store.add("n", -7)]
    said.append(store.compare_set("x", "", "y"))  # missing, nothing expected: set
    said.append(store.compare_set("x", "z", "w"))  # held, not as expected: what it holds
    said.append(store.compare_set("x", "y", "w"))  # held as expected: replaced
    said.append(store.compare_set("q", "e", "f"))  # missing, something expected: nothing set
    said += [store.check(["q"]), store.check(["a", "x"]), store.check(["a", "nothing"])]
    store.multi_set(["m1", "m2"], ["v1", "v2"])
    said.append(store.multi_get(["m1", "m2", "a"]))
    store.append("m1", "+")
    store.append("new", "z")
    said.append(store.multi_get(["m1", "new"]))
    said += [store.delete_key("a"), store.delete_key("a"), store.check(["a"]), store.num_keys()]
    store.set("s", " 12abc")
    said.append(store.add("s", 1))  # as C++'s stoll reads a number
    threading.Timer(0.2, lambda: other.set("late", "L")).start()
    said.append(store.get("late"))  # waits for it
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(RuntimeError, match="timeout"):
        store.get("never")
    said.append(store.get("m2"))  # the same connection, after a wait that timed out
    return said


def test_torchs_client_is_answered_as_torchs_own_server_answers(world_store: StoreServer) -> None:
    torchs = TCPStore(LOOPBACK, 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    expected = script(client(torchs.port), client(torchs.port))
    assert script(client(world_store.port), client(world_store.port)) == expected


KEYS = st.sampled_from(["a", "b", "c"])
VALUES = st.sampled_from(["", "0", "7", "x", "yy"])
CALLS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), KEYS, VALUES),
        st.tuples(st.just("compare_set"), KEYS, VALUES, VALUES),
        st.tuples(st.just("add"), st.sampled_from(["n", "m"]), st.integers(-(2**40), 2**40)),
        st.tuples(st.just("append"), KEYS, VALUES),
        st.tuples(st.just("delete_key"), KEYS),
        st.tuples(st.just("check"), st.lists(KEYS, max_size=3)),
        st.tuples(st.just("multi_set"), st.lists(st.tuples(KEYS, VALUES), min_size=1, max_size=3)),
        st.tuples(st.just("read"), st.lists(st.sampled_from(["a", "b", "c", "n", "m"]), min_size=1, max_size=3)),
        st.tuples(st.just("num_keys")),
    ),
    max_size=25,
)


def replay(store: Any, calls: list[tuple[Any, ...]], space: str) -> list[object]:
    """Each call's answer (None for those answered nothing); a read only of keys that exist
    (torch's client waits for the others)."""
    said: list[object] = []
    for call in calls:
        name, args = call[0], call[1:]
        if name == "multi_set":
            pairs = args[0]
            said.append(store.multi_set([space + k for k, _ in pairs], [v for _, v in pairs]))
        elif name == "check":
            said.append(store.check([space + k for k in args[0]]))
        elif name == "read":
            present = [space + k for k in args[0] if store.check([space + k])]
            said.append(store.multi_get(present) if present else [])
        elif name == "num_keys":
            said.append(store.num_keys())
        else:
            said.append(getattr(store, name)(space + args[0], *args[1:]))
    return said


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=CALLS)
def test_any_calls_are_answered_as_torchs_own_server_answers_them(
    both_clients: tuple[Any, Any], calls: list[tuple[Any, ...]]
) -> None:
    space = f"{secrets.token_hex(4)}/"  # each example's keys its own
    theirs, ours = both_clients
    before = theirs.num_keys(), ours.num_keys()
    expected = replay(theirs, calls, space)
    said = replay(ours, calls, space)
    # num_keys counts every example's keys: as many more than before on each.
    counts = [
        (e - before[0], s - before[1]) for (c, e, s) in zip(calls, expected, said, strict=True) if c[0] == "num_keys"
    ]
    assert all(e == s for e, s in counts), (calls, counts)
    kept = [(c, e, s) for (c, e, s) in zip(calls, expected, said, strict=True) if c[0] != "num_keys"]
    assert [s for _, _, s in kept] == [e for _, e, _ in kept], calls


def test_no_store_lists_its_keys_nor_keeps_queues(world_store: StoreServer, beat_store: StoreServer) -> None:
    torchs = TCPStore(LOOPBACK, 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    for port in (torchs.port, world_store.port):
        client(port).add("w/1/0123456789abcdef/claim/0", 1)
    client(beat_store.port).add("beat/0123456789abcdef", 1)
    # The premise: torch's server lists them, and the secret with them.
    assert b"/w/1/0123456789abcdef/claim/0" in (raw_store.list_keys(LOOPBACK, torchs.port) or [])
    for port in (world_store.port, beat_store.port):
        assert raw_store.list_keys(LOOPBACK, port) is None
        queued = raw(port)
        queued.sendall(raw_store.request(14, raw_store.string(b"q"), raw_store.string(b"v")))  # QUEUE_PUSH
        assert closed(queued)


def test_a_beat_store_takes_additions_to_counters_and_first_verdicts_only(beat_store: StoreServer) -> None:
    host = client(beat_store.port)
    counters = ["beat/host", "news/host", "beat/member"]
    for key in counters:
        host.add(key, 0)
    host.compare_set("verdict/w/1/secret/", "", "")
    for key in counters + ["verdict/w/1/secret/"]:
        for refused in (
            raw_store.request(raw_store.DELETE_KEY, raw_store.string(b"/" + key.encode())),
            raw_store.request(raw_store.SET, raw_store.string(b"/" + key.encode()), raw_store.string(b"junk")),
        ):
            member = raw(beat_store.port)
            member.sendall(refused)
            assert closed(member), (key, refused)
    # What a member may do: move a counter (past its range too), write a verdict.
    member = client(beat_store.port)
    member.add("beat/host", 2**63 - 1)
    member.add("beat/member", 1)
    assert member.compare_set("verdict/w/1/secret/", "", "rank 1 failed") == b"rank 1 failed"
    # The host's reads never wait for a key a member removed, nor meet one it cannot add to.
    began = time.monotonic()
    assert host.add("beat/host", 1) == -(2**63)
    assert host.multi_get(counters) == [str(-(2**63)).encode(), b"0", b"1"]
    assert time.monotonic() - began < 1.0


def test_a_key_or_value_past_its_bound_closes_the_connection(world_store: StoreServer) -> None:
    for payload in (
        raw_store.request(raw_store.SET, raw_store.string(b"k" * (MAX_KEY_BYTES + 1)), raw_store.string(b"v")),
        raw_store.request(raw_store.SET, raw_store.string(b"k"), struct.pack("<Q", MAX_VALUE_BYTES + 1)),
        raw_store.request(raw_store.CHECK, struct.pack("<Q", 2**40)),
        b"\x63",  # no query
    ):
        sock = raw(world_store.port)
        sock.sendall(payload)
        assert closed(sock), payload[:16]
    assert client(world_store.port).add("alive", 1) == 1


def test_one_source_holds_so_many_connections_and_others_still_connect(world_store: StoreServer) -> None:
    held = [raw(world_store.port) for _ in range(MAX_CONNECTIONS_PER_SOURCE)]
    extra = socket.create_connection(
        (LOOPBACK, world_store.port), timeout=CLOSED_WITHIN_S, source_address=(STRANGER, 0)
    )
    assert closed(extra)
    other = raw(world_store.port, OTHER)
    other.sendall(raw_store.request(raw_store.CHECK, struct.pack("<Q", 0)))
    assert other.recv(1) == b"\x00"  # READY
    assert client(world_store.port).add("alive", 1) == 1
    for sock in held:
        sock.close()


def test_one_source_holds_so_many_bytes(world_store: StoreServer) -> None:
    sock = raw(world_store.port)
    value = b"v" * MAX_VALUE_BYTES
    writes = MAX_HELD_BYTES_PER_SOURCE // MAX_VALUE_BYTES + 1
    try:
        for n in range(writes):
            sock.sendall(raw_store.request(raw_store.SET, raw_store.string(b"/k%d" % n), raw_store.string(value)))
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert closed(sock)
    store = client(world_store.port)
    kept = store.num_keys()  # as many values as fit in the bound, entries' overheads counted
    assert kept * MAX_VALUE_BYTES <= MAX_HELD_BYTES_PER_SOURCE < (kept + 1) * (MAX_VALUE_BYTES + 1024)
    store.set("mine", "still written")  # this machine's own processes are bounded by the whole only
    assert store.get("mine") == b"still written"


def test_a_silent_connection_is_closed_and_refusals_are_logged_once_a_source_and_kind(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(store_server, "VALIDATE_WITHIN_S", 0.5)
    server = store_server.serve(LOOPBACK, 0, WORLD_STORE)
    try:
        with caplog.at_level(logging.WARNING, logger=store_server.__name__):
            silent = socket.create_connection((LOOPBACK, server.port), timeout=5.0, source_address=(STRANGER, 0))
            assert closed(silent)
            for _ in range(5):
                refused = raw(server.port, OTHER)
                refused.sendall(b"\x63")
                assert closed(refused)
    finally:
        server.close()
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if STRANGER in m and "silent" in m], said
    assert len([m for m in said if OTHER in m]) == 1, said


def test_a_client_that_takes_no_replies_holds_its_own_and_no_more(world_store: StoreServer) -> None:
    store = client(world_store.port)
    store.set("big", b"v" * (1024 * 1024))
    before = status_field("self", "VmRSS") * 1024
    sock = raw(world_store.port)
    asks = raw_store.request(raw_store.GET, raw_store.string(b"/big")) * 2000  # 2 GiB of replies
    sender = threading.Thread(target=_send_quietly, args=(sock, asks), daemon=True)
    sender.start()
    time.sleep(1.0)
    began = time.monotonic()
    assert store.add("alive", 1) == 1
    assert time.monotonic() - began < 0.5
    assert status_field("self", "VmRSS") * 1024 - before < 64 * 1024 * 1024
    sock.close()
    sender.join(5)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


def test_a_client_that_pipelines_requests_keeps_no_other_waiting(world_store: StoreServer) -> None:
    store = client(world_store.port)
    sock = raw(world_store.port)
    many = raw_store.request(raw_store.CHECK, struct.pack("<Q", 0)) * 500_000  # 4.5 MB of requests
    sender = threading.Thread(target=_send_quietly, args=(sock, many), daemon=True)
    sender.start()
    time.sleep(0.5)
    slowest = 0.0
    for _ in range(20):
        began = time.monotonic()
        store.add("alive", 1)
        slowest = max(slowest, time.monotonic() - began)
    assert slowest < 0.2, slowest
    sock.close()
    sender.join(5)


def test_a_sources_requests_are_paced_past_its_budget_and_this_machines_are_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store_server, "REQUEST_BURST", 100)
    monkeypatch.setattr(store_server, "REQUESTS_PER_S", 200)
    server = store_server.serve(LOOPBACK, 0, WORLD_STORE)
    try:
        answered = {}
        for source in (STRANGER, LOOPBACK):
            sock = raw(server.port, source)
            sock.sendall(raw_store.request(raw_store.CHECK, struct.pack("<Q", 0)) * 2000)
            sock.settimeout(0.2)
            replies, end = 0, time.monotonic() + 2.0
            while time.monotonic() < end:
                try:
                    replies += len(sock.recv(65536))
                except TimeoutError:
                    continue
            answered[source] = replies
            sock.close()
    finally:
        server.close()
    # The burst and 2 s at the rate, give or take a turn of the loop; all of them from 127.0.0.1.
    assert 100 + 200 * 2.0 * 0.7 <= answered[STRANGER] <= 100 + 200 * 2.0 * 1.3, answered
    assert answered[LOOPBACK] == 2000, answered
