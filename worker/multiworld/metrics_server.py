"""The worker's metrics endpoint (metrics.py starts it once MULTIWORLD_METRICS_PORT is set): plain
HTTP on every IPv4 address, as prometheus_client's server was, from one daemon thread.

Whatever reaches the pod may connect, and the user's program shares this process (its CPU, its
GIL), so what connections may cost is bounded:
- MAX_CONNECTIONS open at once, all served by one thread through a selector: no thread per
  connection; MAX_PER_SOURCE of them per source address (a scraper opens one a scrape), a
  connection over its source's count closed at once. A connection past the total closes the
  oldest one still waiting for its request's head of the source that holds the most (a flood
  of silent connections then holds no place for long and takes none from a scraper elsewhere,
  however slowly its request comes; a scraper, which sends its request as it connects, is read
  before the next accepts: see ACCEPTS_AT_ONCE), or is closed at once when every one is past
  its head;
- REQUEST_TIMEOUT_S for the request's head, MAX_HEAD bytes at most (answered 431 past that);
  WRITE_TIMEOUT_S for the answer to be taken; one request per connection;
- the exposition is rendered at most once per FRESH_S (or RENDER_SHARE_INVERSE times what the
  last render took, where longer), whoever asks: what a scrape shows is at most that old.
Past a bound the connection is closed (with a reset: nothing of a flood lingers in the kernel).

GET on any path answers the exposition in the text format 0.0.4, gzipped where the request
accepts gzip, as prometheus_client's server did; another method is answered 405. Standard
library only: `render` brings the exposition.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import logging
import re
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 8
# Half the places: a flood from one address leaves the other half to every other.
MAX_PER_SOURCE = MAX_CONNECTIONS // 2
# Accepted per turn of the loop, after the connections ready were served. Each may close the
# oldest still reading, so a connection accepted in one turn outlives the next turn's accepts
# (when no answer is stuck in a slow reader's socket) and its head, arrived by then, is read.
ACCEPTS_AT_ONCE = MAX_CONNECTIONS // 2
# Connections the kernel holds until accepted (a full queue makes new ones retry).
BACKLOG = 128
REQUEST_TIMEOUT_S = 5.0
# A request's line and headers: a scraper's are a few hundred bytes.
MAX_HEAD = 16 * 1024
WRITE_TIMEOUT_S = 10.0
FRESH_S = 1.0
RENDER_SHARE_INVERSE = 10
# How long the listener rests after an accept failed for want of resources (file descriptors,
# say): it stays ready, and the loop would spin on it.
ACCEPT_PAUSE_S = 0.1
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
END_OF_HEAD = re.compile(rb"\r?\n\r?\n")
REASONS = {200: "OK", 400: "Bad Request", 405: "Method Not Allowed", 431: "Request Header Fields Too Large",
           500: "Internal Server Error"}  # fmt: skip


def start(render: Callable[[], bytes], port: int) -> None:
    """Listen on `port` (OSError here when it is taken) and serve `render`'s exposition there
    from a daemon thread, for the rest of the process."""
    listener = socket.create_server(("0.0.0.0", port), backlog=BACKLOG)
    listener.setblocking(False)
    server = _Server(listener, _Exposition(render))
    threading.Thread(target=server.run, name="multiworld-metrics", daemon=True).start()


class _Exposition:
    """`render`'s text, made again only when FRESH_S old, or RENDER_SHARE_INVERSE times as old
    as its last render took where that is longer; gzipped on demand, once per render."""

    def __init__(self, render: Callable[[], bytes]) -> None:
        self._render = render
        self._at = float("-inf")
        self._took = 0.0
        self._plain = b""
        self._gzipped: bytes | None = None

    def get(self, gzipped: bool) -> bytes:
        now = time.monotonic()
        if now - self._at >= max(FRESH_S, RENDER_SHARE_INVERSE * self._took):
            self._plain, self._gzipped = self._render(), None
            self._at, self._took = now, time.monotonic() - now
        if not gzipped:
            return self._plain
        if self._gzipped is None:
            self._gzipped = gzip.compress(self._plain)
        return self._gzipped


class _Connection:
    """One connection: its source address, what came of its head until it is complete, then
    what is left to send of its answer; when it is closed unless done."""

    __slots__ = ("sock", "source", "head", "answer", "deadline")

    def __init__(self, sock: socket.socket, source: str) -> None:
        self.sock = sock
        self.source = source
        self.head = bytearray()
        self.answer: memoryview | None = None
        self.deadline = time.monotonic() + REQUEST_TIMEOUT_S


class _Server:
    def __init__(self, listener: socket.socket, exposition: _Exposition) -> None:
        self._listener = listener
        self._exposition = exposition
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        # Oldest first; and how many each source address holds.
        self._open: dict[_Connection, None] = {}
        self._held: collections.Counter[str] = collections.Counter()

    def run(self) -> None:
        while True:
            deadline = min((connection.deadline for connection in self._open), default=None)
            ready = self._selector.select(None if deadline is None else max(0.0, deadline - time.monotonic()))
            # The connections first: one accepted last turn is read before any accept may close it.
            for key, _ in ready:
                if key.data is not None:
                    self._step(key.data)
            if any(key.data is None for key, _ in ready):
                self._accept()
            now = time.monotonic()
            for connection in [connection for connection in self._open if connection.deadline <= now]:
                self._close(connection, reset=True)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_AT_ONCE):
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return
            except ConnectionError:
                continue  # gone before it was taken
            except OSError:
                time.sleep(ACCEPT_PAUSE_S)
                return
            source = address[0]
            if self._held[source] >= MAX_PER_SOURCE:
                _reset(sock)
                continue
            if len(self._open) >= MAX_CONNECTIONS:
                reading = self._evictable()
                if reading is None:
                    _reset(sock)
                    continue
                self._close(reading, reset=True)
            sock.setblocking(False)
            connection = _Connection(sock, source)
            self._open[connection] = None
            self._held[source] += 1
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _evictable(self) -> _Connection | None:
        """The oldest connection still reading its head of the source that holds the most of
        those (None: every one is past its head)."""
        reading = [connection for connection in self._open if connection.answer is None]
        if not reading:
            return None
        most = collections.Counter(connection.source for connection in reading)
        top = max(most.values())
        return next(connection for connection in reading if most[connection.source] == top)

    def _step(self, connection: _Connection) -> None:
        try:
            if connection.answer is None:
                self._read(connection)
            else:
                self._write(connection)
        except BlockingIOError:
            pass  # woken for nothing: it waits for its next readiness
        except OSError:
            self._close(connection, reset=True)

    def _read(self, connection: _Connection) -> None:
        data = connection.sock.recv(MAX_HEAD)
        if not data:
            self._close(connection, reset=True)
            return
        # Searched from where the last search left off (less what may begin the end of the head):
        # a head sent a byte at a time costs its length, not its square.
        searched = max(0, len(connection.head) - 3)
        connection.head += data
        end = END_OF_HEAD.search(connection.head, searched)
        if end is None and len(connection.head) <= MAX_HEAD:
            return
        if end is None or end.end() > MAX_HEAD:
            answer = _response(431, f"the request's head is longer than {MAX_HEAD} bytes\n".encode())
        else:
            answer = self._answer(bytes(connection.head[: end.start()]))
        connection.head = bytearray()
        connection.answer = memoryview(answer)
        connection.deadline = time.monotonic() + WRITE_TIMEOUT_S
        self._selector.modify(connection.sock, selectors.EVENT_WRITE, connection)
        self._write(connection)

    def _write(self, connection: _Connection) -> None:
        assert connection.answer is not None
        connection.answer = connection.answer[connection.sock.send(connection.answer) :]
        if not connection.answer:
            self._close(connection, reset=False)

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").splitlines()
        request = lines[0].split() if lines else []
        if len(request) != 3:
            return _response(400, b"not an HTTP request\n")
        if request[0] != "GET":
            return _response(405, b"GET only\n", "Allow: GET\r\n")
        gzipped = any(_accepts_gzip(line) for line in lines[1:])
        try:
            body = self._exposition.get(gzipped)
        except Exception:  # a collector's failure: this request's answer, not the server's end
            log.exception("the worker's metrics could not be rendered")
            return _response(500, b"the metrics could not be rendered\n")
        encoding = "Content-Encoding: gzip\r\n" if gzipped else ""
        return _response(200, body, f"Content-Type: {TEXT_FORMAT}\r\n{encoding}")

    def _close(self, connection: _Connection, reset: bool) -> None:
        del self._open[connection]
        self._held[connection.source] -= 1
        if not self._held[connection.source]:
            del self._held[connection.source]
        self._selector.unregister(connection.sock)
        if reset:
            _reset(connection.sock)
        else:
            connection.sock.close()


def _accepts_gzip(header: str) -> bool:
    name, _, value = header.partition(":")
    return name.strip().lower() == "accept-encoding" and any(
        coding.split(";")[0].strip().lower() == "gzip" for coding in value.split(",")
    )


def _response(code: int, body: bytes, headers: str = "") -> bytes:
    head = f"HTTP/1.1 {code} {REASONS[code]}\r\n{headers}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


def _reset(sock: socket.socket) -> None:
    """Close with a reset: nothing of it lingers in the kernel (no TIME_WAIT for a flood's)."""
    # A socket the peer reset already refuses the option: it is closed all the same.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
