"""What connections to the operator's metrics endpoint may cost (issue 32, finding 6), from raw
sockets (every 127/8 address is this machine's: a test may speak from many sources): a source's
connections past MAX_PER_SOURCE are closed at once; past MAX_CONNECTIONS in all, a connection
still in its request is closed to make room for a scraper's (the oldest of the source holding
the most); one that says nothing, or too much, is closed at its deadline. The real server
(kube/metrics/server.py); the flood against a real operator process: test_metrics_access.py."""

from __future__ import annotations

import gc
import http.client
import select
import ssl
import threading
import time
from asyncio import sslproto
from collections.abc import Iterator

import pytest
from kubernetes import client

from multiworld_operator.kube.admission.serving import TLS_COLLECT_EVERY
from multiworld_operator.kube.client.api import KubeApi
from multiworld_operator.kube.metrics import server as metrics_server
from multiworld_operator.kube.metrics.access import MetricsAccess
from multiworld_operator.kube.metrics.registry import OperatorMetrics
from multiworld_operator.kube.metrics.server import MAX_CONNECTIONS, MAX_HEAD, MAX_PER_SOURCE
from tests.support.operator_metrics import FixedStatuses, planner_status
from tests.support.worker_metrics import closed_within, connect, flood, junk_flood

pytestmark = pytest.mark.quick

# How soon a connection refused at once is seen closed.
CLOSED_WITHIN_S = 1.0


def serve(secure: bool = False) -> OperatorMetrics:
    metrics = OperatorMetrics()
    metrics.read_statuses_from(FixedStatuses({("apps", "mw"): planner_status(w={"phase": "Running"}).view()}))
    # With access, the server speaks TLS (no request here gets as far as a token's check).
    metrics.serve(0, MetricsAccess(KubeApi(client.ApiClient())) if secure else None)
    return metrics


@pytest.fixture
def metrics() -> Iterator[OperatorMetrics]:
    served = serve()
    yield served
    served.close()


def port_of(metrics: OperatorMetrics) -> int:
    assert metrics.server is not None
    return metrics.server.port


def scraped(port: int, source: str = "127.0.0.1") -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert b"multiworld_world_phase{" in response.read()
        return response.status
    finally:
        connection.close()


def test_a_sources_connections_past_its_count_are_closed_at_once(metrics: OperatorMetrics) -> None:
    port = port_of(metrics)
    held = [connect(port, "127.0.0.2") for _ in range(MAX_PER_SOURCE)]
    extra = flood(port, "127.0.0.2", 3)  # any reset as it connected was closed at once too
    try:
        assert [closed_within(sock, CLOSED_WITHIN_S) for sock in extra] == [True] * len(extra)
        assert [closed_within(sock, 0.1) for sock in held] == [False] * MAX_PER_SOURCE
        assert scraped(port) == 200  # another source is served meanwhile
    finally:
        for sock in held + extra:
            sock.close()


def test_past_the_total_a_connection_still_in_its_request_makes_room_for_a_scraper(metrics: OperatorMetrics) -> None:
    """MAX_CONNECTIONS silent ones from sources holding MAX_PER_SOURCE each: a scraper's
    connection closes one of them (of a source that opened more than the scraper's), and the
    scraper gets its answer."""
    port = port_of(metrics)
    flood = [connect(port, f"127.0.1.{1 + i // MAX_PER_SOURCE}") for i in range(MAX_CONNECTIONS)]
    try:
        deadline = time.monotonic() + 5
        while metrics.server is not None and metrics.server.connections < MAX_CONNECTIONS:
            assert time.monotonic() < deadline, metrics.server.connections
            time.sleep(0.01)
        assert scraped(port) == 200
        readable, _, _ = select.select(flood, [], [], CLOSED_WITHIN_S)
        (victim,) = readable  # one closed, no other closed nor sent anything
        assert closed_within(victim, 0)
        assert metrics.server is not None and metrics.server.connections <= MAX_CONNECTIONS
    finally:
        for sock in flood:
            sock.close()


def test_a_silent_connection_and_an_endless_head_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever it sends, a connection gets REQUEST_TIMEOUT_S for its TLS handshake and its
    request's head: one that says nothing, or completes its handshake and then nothing, is
    closed then; a head longer than MAX_HEAD is answered 431 and closed."""
    monkeypatch.setattr(metrics_server, "REQUEST_TIMEOUT_S", 1.0)
    metrics = serve(secure=True)
    port = port_of(metrics)
    try:
        silent = connect(port, "127.0.0.2")
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        handshaken = context.wrap_socket(connect(port, "127.0.0.3"))
        started = time.monotonic()
        assert closed_within(silent, 5.0)
        assert closed_within(handshaken, 5.0)
        assert 0.8 < time.monotonic() - started < 4.0
        endless = context.wrap_socket(connect(port, "127.0.0.4"))
        endless.sendall(b"GET /metrics HTTP/1.1\r\nX-Long: " + b"x" * MAX_HEAD)
        assert endless.recv(4096).startswith(b"HTTP/1.1 431 ")
    finally:
        metrics.close()


def test_a_flood_of_failed_tls_handshakes_holds_a_bounded_number_of_them() -> None:
    """asyncio's TLS leaves each connection's protocol, and its 256 KiB buffer, in reference
    cycles: a flood piled up hundreds (an operator flooded on the node was OOM-killed). A full
    collection every TLS_COLLECT_EVERY connections keeps at most that many, beside those open."""
    metrics = serve(secure=True)
    stop = threading.Event()
    sources = [f"127.0.1.{i}" for i in range(1, 40)]
    flooders = [threading.Thread(target=junk_flood, args=([port_of(metrics)], sources, stop)) for _ in range(4)]
    for flooder in flooders:
        flooder.start()
    most = 0
    try:
        for _ in range(15):
            time.sleep(0.2)
            most = max(most, sum(1 for o in gc.get_objects() if isinstance(o, sslproto.SSLProtocol)))
    finally:
        stop.set()
        for flooder in flooders:
            flooder.join()
        metrics.close()
    assert 0 < most <= TLS_COLLECT_EVERY + MAX_CONNECTIONS, most
