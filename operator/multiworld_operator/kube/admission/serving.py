"""The webhook's HTTPS endpoint: kopf's admission function (`fn`) served by aiohttp on the
operator's event loop, from a listener of its own, bounded, as anything in the cluster can
reach the webhook's Service and the loop is the one every MultiWorld's reconcile runs on:
- a request's body of MAX_REVIEW_BYTES at most: the API server sends an update's object twice
  (as it is and as it was), each up to its object limit (1.5 MiB in etcd). kopf's own server
  took 1 MiB, and refused (413) every update of a large MultiWorld, a label or the operator's
  own patches included;
- MAX_CONNECTIONS open at once. Past them, a connection whose request is not being answered
  (in its handshake, sending a request, or kept alive between requests) is closed for the
  newcomer: the oldest of the source holding the most of those (a flood's: the API server
  sends its request as it connects), or the newcomer when every one is being answered;
- REQUEST_TIMEOUT_S for the TLS handshake and the first whole request, closed past it; a
  connection kept alive between requests (the API server's, which reuses them: a new one to a
  replica that is stopping may meet its closed port before the Service has let it go) goes
  after aiohttp's keep-alive timeout;
- ACCEPTS_AT_ONCE accepts a turn of the loop, which serves the rest between them.
Its owner (tls.AdmissionServer) has it go on serving for a few seconds once the replica stops.
Past a bound the connection is closed with a reset, said in the log once a minute per source.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import json
import logging
import socket
import ssl
import struct
import threading
from typing import cast

import kopf
from aiohttp import web

from multiworld.per_source import QuietLog

log = logging.getLogger(__name__)

MIB = 1 << 20
# An update's review: the object twice, each at most 1.5 MiB, and the review's own fields.
MAX_REVIEW_BYTES = 4 * MIB
# Each holds at most its request (aiohttp reads the body only for a request it serves).
MAX_CONNECTIONS = 32
REQUEST_TIMEOUT_S = 10.0
ACCEPTS_AT_ONCE = 16
# How long the listener rests after an accept failed for want of resources (file descriptors).
ACCEPT_PAUSE_S = 0.1
BACKLOG = 1024
# About 300 KiB each that a full collection frees (_TlsGarbage): 20 MiB at most between two.
TLS_COLLECT_EVERY = 64


class _Connection:
    """One accepted connection: its socket and source, the transport once its TLS handshake
    is done (only it may close the socket from then on), whether a request of it came whole
    (`served`) and one is being answered (`busy`), and the timer of its first request's
    deadline."""

    __slots__ = ("sock", "source", "transport", "served", "busy", "deadline", "task", "handed")

    def __init__(self, sock: socket.socket, source: str) -> None:
        self.sock, self.source = sock, source
        self.transport: asyncio.Transport | None = None
        self.served = False
        self.busy = False
        self.deadline: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        # Handed to asyncio, which closes the socket from then on (a task cancelled before it
        # began never did).
        self.handed = False

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        elif self.task is not None:
            self.task.cancel()  # in its handshake: the transport being made closes the socket


class _Tracked(asyncio.Protocol):
    """aiohttp's protocol for one connection, told to the site as it is made and lost."""

    def __init__(self, inner: asyncio.Protocol, site: AdmissionSite, connection: _Connection) -> None:
        self._inner, self._site, self._connection = inner, site, connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._site.made(self._connection, cast(asyncio.Transport, transport))
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._site.left(self._connection)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class AdmissionSite:
    """Serves `fn` at POST /{webhook id} over TLS with `context` (whose certificate may change
    between connections), once `start`ed, until `close`d."""

    def __init__(self, fn: kopf.WebhookFn, context: ssl.SSLContext) -> None:
        self._fn, self._context = fn, context
        self._open: dict[_Connection, None] = {}  # oldest first
        self._by_transport: dict[asyncio.BaseTransport, _Connection] = {}
        self._listener: socket.socket | None = None
        self._runner: web.AppRunner | None = None
        self._warn = QuietLog("webhook", log).warn

    @property
    def connections(self) -> int:
        return len(self._open)

    async def start(self, host: str, port: int) -> int:
        """Listen on `host`:`port` (host "": every address, IPv6 too where the machine has it;
        port 0: a free one); the port listened on."""
        app = web.Application(client_max_size=MAX_REVIEW_BYTES)
        app.add_routes([web.post("/{id:.*}", self._serve)])
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        if not host and socket.has_dualstack_ipv6():
            listener = socket.create_server(("::", port), family=socket.AF_INET6, backlog=BACKLOG, dualstack_ipv6=True)
        else:
            listener = socket.create_server((host, port), backlog=BACKLOG)
        listener.setblocking(False)
        self._listener = listener
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept)
        return int(listener.getsockname()[1])

    async def close(self, drain_s: float = 0.0) -> None:
        """Stop listening and close every connection, after serving `drain_s` more seconds."""
        await asyncio.sleep(drain_s)
        if self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for connection in list(self._open):
            connection.abort()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _accept(self) -> None:
        assert self._listener is not None and self._runner is not None
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPTS_AT_ONCE):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                self._warn(("accept",), "cannot accept a connection: %s", error)
                fileno = self._listener.fileno()
                loop.remove_reader(fileno)
                loop.call_later(ACCEPT_PAUSE_S, loop.add_reader, fileno, self._accept)
                return
            connection = _Connection(sock, str(address[0]))
            if len(self._open) >= MAX_CONNECTIONS:
                victim = self._evictable()
                if victim is None:
                    self._warn(("busy",), "%d connections are being answered; closed a new one", MAX_CONNECTIONS)
                    reset(sock)
                    continue
                self._warn(("full", victim.source), "%s holds the most idle connections; closed one", victim.source)
                self.left(victim)
                victim.abort()
            sock.setblocking(False)
            tls_connection_opened()
            self._open[connection] = None
            connection.deadline = loop.call_later(REQUEST_TIMEOUT_S, self._expire, connection)
            connection.task = loop.create_task(self._handshake(connection))
            connection.task.add_done_callback(functools.partial(self._handshaken, connection))

    async def _handshake(self, connection: _Connection) -> None:
        """The TLS handshake, then aiohttp's protocol serves the connection."""
        assert self._runner is not None and self._runner.server is not None
        server = self._runner.server
        connection.handed = True
        await asyncio.get_running_loop().connect_accepted_socket(
            lambda: _Tracked(server(), self, connection),
            connection.sock,
            ssl=self._context,
            ssl_handshake_timeout=REQUEST_TIMEOUT_S,
        )

    def _evictable(self) -> _Connection | None:
        """The oldest connection whose request is not being answered, of the source that holds
        the most of those (None: every one is being answered)."""
        idle = [connection for connection in self._open if not connection.busy]
        if not idle:
            return None
        most = collections.Counter(connection.source for connection in idle)
        top = max(most.values())
        return next(connection for connection in idle if most[connection.source] == top)

    def _handshaken(self, connection: _Connection, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is not None:
            # Not TLS, too slow, or closed for another: asyncio closed what it was handed.
            self.left(connection)
            if not connection.handed:
                reset(connection.sock)

    def _expire(self, connection: _Connection) -> None:
        if connection in self._open and not connection.served:
            self._warn(
                ("slow", connection.source),
                "%s sent no whole request within %.0f s; closed",
                connection.source,
                REQUEST_TIMEOUT_S,
            )
            self.left(connection)
            connection.abort()

    def made(self, connection: _Connection, transport: asyncio.Transport) -> None:
        connection.transport = transport
        self._by_transport[transport] = connection

    def left(self, connection: _Connection) -> None:
        """It closes, or is closed: it counts no more."""
        self._open.pop(connection, None)
        if connection.transport is not None:
            self._by_transport.pop(connection.transport, None)
        if connection.deadline is not None:
            connection.deadline.cancel()

    async def _serve(self, request: web.Request) -> web.Response:
        connection = self._by_transport.get(request.transport) if request.transport is not None else None
        if connection is None:
            raise web.HTTPServiceUnavailable(reason="the connection was closed")
        body = await request.read()  # within the first request's deadline, MAX_REVIEW_BYTES at most
        connection.served = connection.busy = True
        if connection.deadline is not None:
            connection.deadline.cancel()
        try:
            review = json.loads(body)
            sslpeer = request.transport.get_extra_info("peercert") if request.transport is not None else None
            answer = await self._fn(
                review, webhook=request.match_info["id"], headers=dict(request.headers), sslpeer=sslpeer
            )
        except Exception as error:  # a review that is not one (kopf says what is missing)
            self._warn(("bad", connection.source), "%s sent a request that is no review: %s", connection.source, error)
            response = web.json_response({"error": str(error)}, status=400)
        else:
            response = web.json_response(answer)
        finally:
            connection.busy = False
        return response


class _TlsGarbage:
    """asyncio's TLS (sslproto, as of Python 3.11) leaves each connection's protocol, with its
    256 KiB read buffer, in reference cycles (with its transport, and through the traceback of a
    failed handshake) that only a full garbage collection frees, and the collector's own
    schedule runs one rarely once the heap is large: a flood of junk connections to the webhook
    from one pod piled them up until the operator was OOM-killed, 2 s after each start. A full
    collection every TLS_COLLECT_EVERY connections given to TLS (the webhook's and the
    metrics') bounds what they hold; any thread may count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = 0

    def opened(self) -> None:
        with self._lock:
            self._since += 1
            if self._since < TLS_COLLECT_EVERY:
                return
            self._since = 0
        gc.collect()


tls_connection_opened = _TlsGarbage().opened


def reset(sock: socket.socket) -> None:
    """Close with a reset: nothing of a flood's connections lingers in the kernel (no
    TIME_WAIT). The metrics server's too."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
