"""The worker's metrics endpoint seen from outside (tests/worker/test_worker_metrics_bounds.py):
a process that serves it, and HTTP spoken over raw sockets (`connect`, `closed_within` and
`junk_flood` serve the operator's metrics server's tests and bench/attacks.py too).

`python -m tests.support.worker_metrics PORT` (from the repository root) serves the worker's
metrics on PORT as a WorldManager given that port does (`multiworld.metrics.serve`), counts a
join of world `w` every millisecond so that no two renders of its exposition are alike, says
{"event": "serving"} and ends when its stdin closes. No torch: it starts in a moment.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
import threading
import time
from typing import Protocol

from multiworld import metrics

JOIN_EVERY_S = 0.001


def main() -> None:
    metrics.serve(int(sys.argv[1]))
    threading.Thread(target=_join_forever, name="joins", daemon=True).start()
    print(json.dumps({"event": "serving"}), flush=True)
    sys.stdin.read()


def _join_forever() -> None:
    while True:
        metrics.world_joined("w")
        time.sleep(JOIN_EVERY_S)


def threads(pid: int) -> int:
    """The threads process `pid` has now."""
    return len(os.listdir(f"/proc/{pid}/task"))


def connect(port: int, source: str = "127.0.0.1", timeout: float = 10.0) -> socket.socket:
    """A connection to a server on this machine's `port` from `source` (any loopback address:
    the server sees another source address for each)."""
    return socket.create_connection(("127.0.0.1", port), timeout, source_address=(source, 0))


def flood(port: int, source: str, count: int) -> list[socket.socket]:
    """`count` connections from `source` that say nothing, those the server took (one it reset
    as it connected is left out)."""
    opened = []
    for _ in range(count):
        try:
            opened.append(connect(port, source))
        except ConnectionResetError:
            continue
    return opened


# What a junk flood sends, a connection each in turn: nothing, binary, a line past every bound,
# plain HTTP (to a TLS port: junk all the same).
JUNK = (b"", b"\x00\xff" * 64, b"{" * 300_000, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")


class Stop(Protocol):
    """What ends a flood: a threading or a multiprocessing Event."""

    def is_set(self) -> bool: ...


def junk_flood(ports: list[int], sources: list[str], stop: Stop) -> int:
    """Until `stop`: a connection to each of `ports` in turn, from each of `sources` in turn, that
    sends the next of JUNK and closes; the connections made."""
    made = 0
    while not stop.is_set():
        try:
            with connect(ports[made % len(ports)], sources[made % len(sources)], timeout=1.0) as sock:
                sock.sendall(JUNK[made % len(JUNK)])
        except OSError:
            pass
        made += 1
    return made


def request(port: int, head: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (names in lower case) and body that `head`, sent as is on a
    connection of its own, is answered, read until the server closes."""
    with connect(port, timeout=timeout) as sock:
        return exchange(sock, head)


def exchange(sock: socket.socket, head: bytes) -> tuple[int, dict[str, str], bytes]:
    """`request`'s answer to `head` on a connection made already."""
    sock.sendall(head)
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    answer_head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    if not answer_head:
        raise ConnectionResetError("closed without an answer")
    status, *header_lines = answer_head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
    return int(status.split()[1]), headers, body


def get(port: int, path: str = "/metrics", headers: str = "") -> tuple[int, dict[str, str], bytes]:
    return request(port, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Connection: close\r\n\r\n".encode())


def closed_within(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes `sock` (a reset counts, and on a TLS socket its session cut
    off) within `timeout`, having sent nothing (any server: the operator's metrics server's and
    the webhook's tests use it too)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except (ConnectionResetError, ssl.SSLError):
        return True


if __name__ == "__main__":
    main()
