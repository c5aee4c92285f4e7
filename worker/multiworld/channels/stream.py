"""The channel to a platform over TCP: newline-delimited ChannelMessage JSON.

- `local://HOST:PORT`: the local runner (`multiworld run`), which trusts its own processes.
- `operator://HOST:PORT`: the operator. Every connection opens with a hello that carries the
  pod's projected ServiceAccount token (re-read from its file on every connection: the kubelet
  rotates it), which the operator checks once per connection. The worker needs no Kubernetes
  permission at all: it never calls the API.

The worker sends `hello`, then its latest `status` and its latest report per world (resent on
every connection: a platform that restarted has lost them), then `status` and `report` messages
as they come; the platform sends `table` messages (this pod's entries only), or `refused` before
it closes a connection it will not serve. One thread writes (and reconnects), one thread per
connection reads; callers only queue.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import ValidationError

from multiworld.channels.base import TableCallback
from multiworld.contract import (
    ENV_TABLE,
    ENV_TOKEN_FILE,
    TOKEN_PATH,
    BrokenWorldReport,
    ChannelMessage,
    Hello,
    WorkerStatus,
    WorldTable,
)

log = logging.getLogger(__name__)

SCHEMES = ("local", "operator")
_RETRY = 0.5
# A refused connection is retried more slowly, up to this (a new token, or the operator learning
# of this pod, may let the next one through).
_REFUSED_RETRY_MAX = 10.0
_CLOSE_FLUSH = 1.0
# A platform that vanished without closing (its pod deleted, its address gone: no FIN, no RST
# ever comes) must not hold a worker on a dead connection: TCP keepalive probes after this much
# silence, every interval, this many times; unacknowledged sends give up after the user timeout.
_KEEPALIVE_IDLE_S = 5
_KEEPALIVE_INTERVAL_S = 2
_KEEPALIVE_PROBES = 3
_USER_TIMEOUT_MS = 10_000
_RECONNECT = object()  # queued to (re)connect with nothing to send: at start, or after a drop


def parse_url(url: str) -> tuple[str, str, int]:
    """'local://HOST:PORT' or 'operator://HOST:PORT' -> (scheme, host, port)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in SCHEMES or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"{ENV_TABLE}={url!r}: expected local://HOST:PORT or operator://HOST:PORT")
    return parts.scheme, parts.hostname, port


class StreamChannel:
    """`token_file`: where this pod's token is (None: say no token, as for the local runner)."""

    def __init__(self, host: str, port: int, pod: str, token_file: Path | None = None) -> None:
        self._address = (host, port)
        self._pod = pod
        self._token_file = token_file
        self._queue: queue.SimpleQueue[ChannelMessage | object | None] = queue.SimpleQueue()
        self._on_table: TableCallback | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._latest_status: WorkerStatus | None = None
        # The latest report per world, until a table shows that world past the report's epoch.
        self._reports: dict[str, BrokenWorldReport] = {}
        self._refused = ""
        self._refused_delay = _RETRY
        self._closed = threading.Event()
        self._drained = threading.Event()
        self._writer: threading.Thread | None = None

    def start(self, on_table: TableCallback) -> None:
        self._on_table = on_table
        self._queue.put(_RECONNECT)  # connect at once: the table may be waiting
        self._writer = threading.Thread(target=self._write_loop, name="mw-channel", daemon=True)
        self._writer.start()

    def report(self, report: BrokenWorldReport) -> None:
        with self._lock:
            self._reports[report.world] = report
        self._queue.put(ChannelMessage(report=report))

    def status(self, status: WorkerStatus) -> None:
        self._latest_status = status
        self._queue.put(ChannelMessage(status=status))

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._queue.put(None)
        if self._writer is not None:
            self._drained.wait(_CLOSE_FLUSH)
        sock, self._sock = self._sock, None
        if sock is not None:
            _shut(sock)

    def _write_loop(self) -> None:
        message: ChannelMessage | object | None = None
        while True:
            if message is None:
                message = self._queue.get()
                if message is None:
                    break
            sock = self._sock or self._connect()
            if sock is None:
                break  # closed while disconnected
            if message is _RECONNECT:
                message = None
                continue
            assert isinstance(message, ChannelMessage)
            try:
                sock.sendall(message.encode())
                message = None
            except OSError as exc:
                log.debug("channel: send failed (%s); reconnecting", exc)
                self._forget(sock)
        self._drained.set()

    def _greeting(self) -> bytes:
        """hello, then what a platform that lost this connection's state needs again."""
        greeting = ChannelMessage(hello=Hello(pod=self._pod, token=self._token())).encode()
        if self._latest_status is not None:
            greeting += ChannelMessage(status=self._latest_status).encode()
        with self._lock:
            reports = list(self._reports.values())
        return greeting + b"".join(ChannelMessage(report=r).encode() for r in reports)

    def _token(self) -> str:
        if self._token_file is None:
            return ""
        try:
            return self._token_file.read_text().strip()
        except OSError as exc:
            # Said, and sent empty: the operator refuses it and says why too.
            log.warning("channel: cannot read this pod's token %s (%s)", self._token_file, exc)
            return ""

    def _connect(self) -> socket.socket | None:
        while not self._closed.is_set():
            try:
                sock = socket.create_connection(self._address, timeout=_RETRY * 4)
                sock.settimeout(None)
                _detect_a_vanished_peer(sock)
                sock.sendall(self._greeting())
            except OSError as exc:
                log.debug("channel: cannot reach %s:%d (%s)", *self._address, exc)
                self._closed.wait(_RETRY)
                continue
            self._sock = sock
            threading.Thread(target=self._read_loop, args=(sock,), name="mw-channel-read", daemon=True).start()
            return sock
        return None

    def _forget(self, sock: socket.socket) -> None:
        if self._sock is sock:
            self._sock = None
        _shut(sock)

    def _read_loop(self, sock: socket.socket) -> None:
        refused = False
        try:
            with sock.makefile("rb") as lines:
                for line in lines:
                    if line.strip():
                        refused = self._deliver(line) or refused
        except OSError:
            pass
        self._forget(sock)
        if not self._closed.is_set():
            self._closed.wait(self._refused_delay if refused else _RETRY)
            self._queue.put(_RECONNECT)

    def _deliver(self, line: bytes) -> bool:
        """Hand a table on; True when the platform refused this connection."""
        try:
            message = ChannelMessage.decode(line)
        except ValidationError as exc:
            log.warning("channel: ignoring a bad message: %s", exc)
            return False
        if message.refused is not None:
            self._note_refusal(message.refused)
            return True
        if message.table is None or self._on_table is None:
            return False
        self._refused, self._refused_delay = "", _RETRY
        self._forget_reports_past(message.table)
        try:
            self._on_table(message.table)
        except Exception:
            log.exception("channel: applying table revision %d failed", message.table.revision)
        return False

    def _note_refusal(self, reason: str) -> None:
        """Said once per distinct reason (at warning: the worker is cut off from its platform
        until this heals), then retried more and more slowly."""
        if reason != self._refused:
            log.warning("channel: %s:%d refused this pod: %s", *self._address, reason)
        self._refused = reason
        self._refused_delay = min(_REFUSED_RETRY_MAX, self._refused_delay * 2)

    def _forget_reports_past(self, table: WorldTable) -> None:
        epochs = {w.name: w.epoch for w in table.worlds}
        with self._lock:
            for world, report in list(self._reports.items()):
                if epochs.get(world, report.epoch + 1) > report.epoch:
                    del self._reports[world]


def _detect_a_vanished_peer(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", _KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", _KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", _USER_TIMEOUT_MS),
    ):
        if hasattr(socket, option):  # Linux has them all; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def from_url(url: str, pod: str) -> StreamChannel:
    scheme, host, port = parse_url(url)
    token_file = Path(os.environ.get(ENV_TOKEN_FILE) or TOKEN_PATH) if scheme == "operator" else None
    return StreamChannel(host, port, pod, token_file)
