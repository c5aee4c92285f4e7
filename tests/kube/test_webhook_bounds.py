"""What connections may cost the admission webhook's endpoint (kube/admission/serving.py), from
raw sockets and a real TLS client against the real server on loopback, serving an admission
function that allows every review: an update's review as large as the API server sends is
answered (kopf's server refused past 1 MiB: 413), a flood of silent connections holds no
more than MAX_CONNECTIONS and keeps no review from its answer, and a connection that sends no
whole request is closed at its deadline. Every 127/8
address is this machine's: a test speaks from as many sources as it needs."""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from multiworld_operator.kube.admission import serving
from multiworld_operator.kube.admission.certificate import self_signed
from multiworld_operator.kube.admission.serving import MAX_CONNECTIONS, AdmissionSite
from multiworld_operator.kube.admission.tls import load_pair
from tests.support.worker_metrics import closed_within, connect, flood

pytestmark = pytest.mark.quick

FLOOD = 300
# A review as the API server sends an update of an object at its limit (1.5 MiB), twice over.
LARGE_REVIEW_BYTES = 3 * 1024 * 1024
DEADLINE_S = 1.0


class Site:
    """The server on a loop of its own thread; the reviews it was given, by uid."""

    def __init__(self) -> None:
        certificate, key = self_signed(["localhost"], datetime.now(UTC))
        self.certificate = certificate
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        load_pair(context, (certificate, key))
        self.reviewed: list[str] = []
        self.site = AdmissionSite(self._allow, context)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.port = self.loop.run_until_complete(self.site.start("127.0.0.1", 0))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)

    async def _allow(self, request: Any, **_: Any) -> Any:
        uid = request["request"]["uid"]
        self.reviewed.append(uid)
        response = {"uid": uid, "allowed": True}
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}

    @property
    def connections(self) -> int:
        return asyncio.run_coroutine_threadsafe(self._count(), self.loop).result(5)

    async def _count(self) -> int:
        return self.site.connections

    def review(self, uid: str, padding: int = 0, source: str = "127.0.0.1") -> tuple[int, dict[str, str], Any]:
        """POST a review as the API server does, over TLS: the status, headers and body."""
        context = ssl.create_default_context(cadata=self.certificate.decode())
        connection = http.client.HTTPSConnection(
            "localhost", self.port, context=context, timeout=10, source_address=(source, 0)
        )
        request: dict[str, Any] = {"uid": uid}
        if padding:
            request["object"] = {"padding": "x" * padding}
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
        try:
            connection.request("POST", "/spec", json.dumps(review), {"Content-Type": "application/json"})
            response = connection.getresponse()
            body = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(body)
        finally:
            connection.close()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.site.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def site(monkeypatch: pytest.MonkeyPatch) -> Iterator[Site]:
    monkeypatch.setattr(serving, "REQUEST_TIMEOUT_S", DEADLINE_S)
    served = Site()
    try:
        yield served
    finally:
        served.close()


def test_a_review_as_large_as_an_update_of_the_largest_object_is_answered(site: Site) -> None:
    status, headers, body = site.review("large", padding=LARGE_REVIEW_BYTES)
    assert status == 200, body
    assert body["response"] == {"uid": "large", "allowed": True}
    assert site.reviewed == ["large"]


def test_a_flood_of_silent_connections_holds_a_bounded_count_and_no_review_waits(site: Site) -> None:
    silent = flood(site.port, "127.0.0.2", FLOOD)
    try:
        time.sleep(0.3)  # the flood accepted (or reset)
        assert site.connections <= MAX_CONNECTIONS
        started = time.monotonic()
        status, _, body = site.review("during")
        took = time.monotonic() - started
        assert status == 200 and body["response"]["allowed"], body
        print(f"{len(silent)} of {FLOOD} silent connections taken; a review meanwhile answered in {took:.3f} s")
        assert took < DEADLINE_S
    finally:
        for sock in silent:
            sock.close()


def test_a_connection_that_sends_no_whole_request_is_closed_at_its_deadline(site: Site) -> None:
    """Silent, in its TLS handshake; or past the handshake with a request's head and part of
    its body."""
    context = ssl.create_default_context(cadata=site.certificate.decode())
    with connect(site.port, "127.0.0.3") as silent, connect(site.port, "127.0.0.4") as raw:
        partial = context.wrap_socket(raw, server_hostname="localhost")
        partial.sendall(b"POST /spec HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n{")
        started = time.monotonic()
        assert closed_within(silent, DEADLINE_S + 3)
        assert closed_within(partial, DEADLINE_S + 3)
        assert time.monotonic() - started > DEADLINE_S - 0.3
    assert site.reviewed == []
