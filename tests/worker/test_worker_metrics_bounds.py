"""What connections may cost the worker's metrics endpoint (multiworld.metrics_server), from raw
sockets against a process that serves it (tests/support/worker_metrics.py): its threads under a
flood of silent connections and a scrape's wait meanwhile, a source's count, a flood from one
source beside a slow scraper, the deadline and the cap of a request's head, renders per second;
and that it serves what prometheus_client's server did. Every 127/8 address is this machine's:
a test speaks from as many sources as it needs."""

from __future__ import annotations

import gzip
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from multiworld.metrics_server import FRESH_S, MAX_HEAD, MAX_PER_SOURCE, REQUEST_TIMEOUT_S, TEXT_FORMAT
from multiworld_operator.local.store_ports import free_store_ports
from tests.support.members import Member
from tests.support.worker_metrics import closed_within, connect, exchange, flood, get, request, threads

REPO = Path(__file__).resolve().parents[2]
FLOOD = 200
SCRAPE_WITHIN_S = 2.0
JOINS = "multiworld_worker_joins_total"


class Served(NamedTuple):
    pid: int
    port: int


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    port = free_store_ports(1)[0]
    member = Member(["-m", "tests.support.worker_metrics", str(port)], "metrics", cwd=REPO)
    try:
        member.wait_for("serving", timeout=30)
        yield Served(member.pid, port)
    finally:
        member.kill()


def joins(text: str) -> float:
    """The joins of world `w` in an exposition."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == JOINS and sample.labels == {"world": "w"}:
                return sample.value
    raise AssertionError(f"no {JOINS} in:\n{text}")


def test_a_flood_of_silent_connections_costs_no_thread_and_holds_up_no_scrape(served: Served) -> None:
    port = served.port
    before = threads(served.pid)
    silent = flood(port, "127.0.0.5", FLOOD)
    try:
        started = time.monotonic()
        # A real client: it connects after the whole flood, so it is accepted after all of it.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        took = time.monotonic() - started
        during = threads(served.pid)
    finally:
        for sock in silent:
            sock.close()
    print(f"threads {before} before {FLOOD} silent connections, {during} during; the scrape took {took:.3f} s")
    assert during <= before, f"{during - before} more threads under a flood of {FLOOD} connections"
    assert took < SCRAPE_WITHIN_S
    assert joins(text) > 0


def test_a_sources_connections_past_its_count_are_closed_at_once(served: Served) -> None:
    held = [connect(served.port, "127.0.0.2") for _ in range(MAX_PER_SOURCE)]
    extra = flood(served.port, "127.0.0.2", 3)  # any reset as it connected was closed at once too
    try:
        assert [closed_within(sock, 2.0) for sock in extra] == [True] * len(extra)
        assert [closed_within(sock, 0.1) for sock in held] == [False] * MAX_PER_SOURCE
        assert get(served.port)[0] == 200  # another source is served meanwhile
    finally:
        for sock in held + extra:
            sock.close()


def test_a_flood_from_one_source_takes_no_place_from_a_slow_scraper_elsewhere(served: Served) -> None:
    """A scraper whose request comes a while after its connection (a slow link), and meanwhile
    a flood of silent connections from one other source: the scraper keeps its place and is
    answered. It used to be the oldest connection still reading, the first the flood closed."""
    scraper = connect(served.port, "127.0.0.3")
    silent: list[socket.socket] = []
    try:
        time.sleep(0.2)  # accepted
        silent = flood(served.port, "127.0.0.4", FLOOD)
        time.sleep(0.5)  # the flood taken: its connections past its source's count reset
        status, _, body = exchange(scraper, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert status == 200 and joins(body.decode()) > 0
    finally:
        scraper.close()
        for sock in silent:
            sock.close()


def test_a_silent_connection_is_closed_at_the_deadline(served: Served) -> None:
    with connect(served.port) as silent:
        started = time.monotonic()
        assert closed_within(silent, REQUEST_TIMEOUT_S + 3)
        assert time.monotonic() - started > REQUEST_TIMEOUT_S - 0.5


def test_a_head_over_the_cap_is_answered_431(served: Served) -> None:
    def head(size: int) -> bytes:
        line = b"GET /metrics HTTP/1.1\r\nX-Padding: "
        return line + b"x" * (size - len(line) - 4) + b"\r\n\r\n"

    assert request(served.port, head(MAX_HEAD))[0] == 200
    assert request(served.port, head(MAX_HEAD + 1))[0] == 431


def test_scrapes_in_a_second_render_the_exposition_at_most_twice(served: Served) -> None:
    """The process counts a join every millisecond: each render shows another count."""
    seen, scrapes = set(), 0
    started = time.monotonic()
    while time.monotonic() - started < 0.9 * FRESH_S:
        seen.add(joins(get(served.port)[2].decode()))
        scrapes += 1
    print(f"{scrapes} scrapes in {0.9 * FRESH_S} s saw {len(seen)} renders")
    assert scrapes >= 10
    assert len(seen) <= 2, f"{scrapes} scrapes saw {len(seen)} renders"


def test_it_serves_the_text_format_gzipped_when_asked_on_any_path(served: Served) -> None:
    port = served.port
    status, headers, body = get(port, "/", "Accept-Encoding: identity, gzip;q=0.5\r\n")
    assert (status, headers["content-type"], headers["content-encoding"]) == (200, TEXT_FORMAT, "gzip")
    assert joins(gzip.decompress(body).decode()) > 0
    status, headers, body = get(port)
    assert (status, headers["content-type"], "content-encoding" in headers) == (200, TEXT_FORMAT, False)
    assert joins(body.decode()) > 0
    assert request(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")[0] == 405
