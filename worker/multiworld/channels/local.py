"""The local runner's channel: TCP to `local://HOST:PORT`, newline-delimited ChannelMessage JSON.

The worker sends `hello` (its pod name) on every connection, then `status` and `report`
messages; the runner sends `table` messages. One thread writes (and reconnects), one thread
per connection reads; callers only queue.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from urllib.parse import urlsplit

from pydantic import ValidationError

from multiworld.channels.base import TableCallback
from multiworld.contract import ENV_TABLE, BrokenWorldReport, ChannelMessage, WorkerStatus

log = logging.getLogger(__name__)

_RETRY = 0.5
_CLOSE_FLUSH = 1.0
_RECONNECT = object()  # queued to (re)connect with nothing to send: at start, or after a drop


def parse_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "local" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"{ENV_TABLE}={url!r}: expected local://HOST:PORT")
    return parts.hostname, port


class LocalChannel:
    def __init__(self, host: str, port: int, pod: str) -> None:
        self._address = (host, port)
        self._pod = pod
        self._queue: queue.SimpleQueue[ChannelMessage | object | None] = queue.SimpleQueue()
        self._on_table: TableCallback | None = None
        self._sock: socket.socket | None = None
        self._latest_status: WorkerStatus | None = None
        self._closed = threading.Event()
        self._drained = threading.Event()
        self._writer: threading.Thread | None = None

    def start(self, on_table: TableCallback) -> None:
        self._on_table = on_table
        self._queue.put(_RECONNECT)  # connect at once: the table may be waiting
        self._writer = threading.Thread(target=self._write_loop, name="mw-channel-local", daemon=True)
        self._writer.start()

    def report(self, report: BrokenWorldReport) -> None:
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
                log.debug("local channel: send failed (%s); reconnecting", exc)
                self._forget(sock)
        self._drained.set()

    def _connect(self) -> socket.socket | None:
        while not self._closed.is_set():
            try:
                sock = socket.create_connection(self._address, timeout=_RETRY * 4)
                sock.settimeout(None)
                greeting = ChannelMessage(hello=self._pod).encode()
                if self._latest_status is not None:
                    greeting += ChannelMessage(status=self._latest_status).encode()
                sock.sendall(greeting)
            except OSError as exc:
                log.debug("local channel: cannot reach %s:%d (%s)", *self._address, exc)
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
        try:
            with sock.makefile("rb") as lines:
                for line in lines:
                    if line.strip():
                        self._deliver(line)
        except OSError:
            pass
        self._forget(sock)
        if not self._closed.is_set():
            self._closed.wait(_RETRY)
            self._queue.put(_RECONNECT)

    def _deliver(self, line: bytes) -> None:
        try:
            message = ChannelMessage.decode(line)
        except ValidationError as exc:
            log.warning("local channel: ignoring a bad message: %s", exc)
            return
        if message.table is None or self._on_table is None:
            return
        try:
            self._on_table(message.table)
        except Exception:
            log.exception("local channel: applying table revision %d failed", message.table.revision)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def from_url(url: str, pod: str) -> LocalChannel:
    host, port = parse_url(url)
    return LocalChannel(host, port, pod)
