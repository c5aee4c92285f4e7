"""The operator's metrics endpoint (`multiworld operator --metrics-port`): GET /metrics over
HTTPS, each request's bearer token checked (access.py), served on an event loop of its
own in a thread of its own, so that neither a flood of connections nor a render holds up the
reconcile loops for more than a bounded share of the process.

Anything in the cluster can connect, so what connections may cost is bounded:
- MAX_CONNECTIONS open at once, MAX_PER_SOURCE of them per source address (Prometheus opens one
  per scrape; a pair of Prometheus replicas are two sources). A connection over its source's
  count is closed at once; one over the total closes a connection still in its TLS handshake or
  its request's head, the oldest of the source that opened the most lately (a flood re-opens
  what is closed; a scraper opens one connection a scrape), or is closed at once when none is;
- REQUEST_TIMEOUT_S for the handshake and the request's head, which may be MAX_HEAD bytes long;
  WRITE_TIMEOUT_S for the answer to be read; one request per connection (`Connection: close`);
- the exposition is rendered at most once per FRESH_S (or RENDER_SHARE_INVERSE times what the
  last render took, where longer), whoever asks and however often: a flood of allowed scrapes
  costs one render a second, or a tenth of the process's time (what it shows is at most that
  old).
Past a bound the connection is closed (or answered 429/431), said in the log once a minute per
source with a count.

Without `access` (`--no-metrics-secure`) the same server speaks plain HTTP to anyone: for a port
nothing else can reach.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gzip
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from multiworld.per_source import QuietLog
from multiworld_operator.kube.admission.certificate import CertificatePair, self_signed
from multiworld_operator.kube.admission.serving import reset, tls_connection_opened
from multiworld_operator.kube.admission.tls import load_pair
from multiworld_operator.kube.metrics.access import METRICS_PATH, MetricsAccess, Verdict

log = logging.getLogger(__name__)

KIB = 1 << 10
# Each TLS connection holds a 256 KiB buffer (asyncio's): 32 of them about 9 MiB.
MAX_CONNECTIONS = 32
MAX_PER_SOURCE = 4
# Connections the kernel holds for the server to accept (a full queue drops new ones), and
# how many it takes at once before serving those it holds again (each may close one held: the
# sockets of those closed go at the loop's next turn).
BACKLOG = 1024
ACCEPTS_AT_ONCE = 16
ACCEPT_PAUSE_S = 0.1
REQUEST_TIMEOUT_S = 5.0
# A request's line and headers: a ServiceAccount token is about 1 KiB.
MAX_HEAD = 16 * KIB
WRITE_TIMEOUT_S = 10.0
FRESH_S = 1.0
RENDER_SHARE_INVERSE = 10
# How fast what a source opened is forgotten (see _Connections), and how many sources are
# remembered before those that opened little lately are forgotten (then twice as many as kept).
OPENED_HALF_LIFE_S = 10.0
MAX_SOURCES_REMEMBERED = 4096
# How long a check of a token may take before the request is answered 503.
CHECK_TIMEOUT_S = 15.0
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
STARTUP_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 2.0


class Exposition:
    """The text `render` makes, made again only when `fresh_s` old, or RENDER_SHARE_INVERSE times
    as old as the last render took where that is longer (a MultiWorld of 512 worlds takes a
    tenth of a second: rendering then takes at most a tenth of the process's time); gzipped on
    demand, once. `fresh_s` 0: made for every request (a test's)."""

    def __init__(self, render: Callable[[], bytes], fresh_s: float = FRESH_S) -> None:
        self.render, self.fresh_s = render, fresh_s
        self._at = float("-inf")
        self._took = 0.0
        self._plain = b""
        self._gzipped: bytes | None = None

    def get(self, gzipped: bool) -> bytes:
        now = time.monotonic()
        if not self.fresh_s or now - self._at >= max(self.fresh_s, RENDER_SHARE_INVERSE * self._took):
            self._plain, self._gzipped = self.render(), None
            self._at, self._took = now, time.monotonic() - now
        if not gzipped:
            return self._plain
        if self._gzipped is None:
            self._gzipped = gzip.compress(self._plain, compresslevel=1)
        return self._gzipped


class _Connection:
    """One connection: its socket, its source address, the task that serves it, and once made
    the transport that owns the socket (only it may close the socket then: a socket closed
    under it would leave its file descriptor's number, reused by the next connection,
    registered as its own)."""

    __slots__ = ("sock", "source", "task", "transport")

    def __init__(self, sock: socket.socket, source: str) -> None:
        self.sock, self.source = sock, source
        self.task: asyncio.Task[None] | None = None
        self.transport: asyncio.Transport | None = None

    def abort(self) -> None:
        """Closed now; its task, cancelled, lets go of what it holds (a cancellation that came
        as what it awaited ended may be lost: the transport's abort ends that wait too)."""
        if self.task is None:
            reset(self.sock)
            return
        self.task.cancel()
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        # A transport cancelled while it was being made let go of the socket as it stopped.
        if self.transport is not None:
            self.transport.abort()
        else:
            reset(self.sock)


class _Connections:
    """The connections open: at most MAX_PER_SOURCE of a source and MAX_CONNECTIONS in all. Past
    the total, one still in its handshake or head is closed for a newcomer: the oldest of the
    source that opened the most lately (a flood's: each of its connections closed is opened
    again, where a scraper opens one a scrape), which a flood from many sources holding one
    connection each would otherwise make a scraper's."""

    def __init__(self) -> None:
        self._open: dict[_Connection, None] = {}
        self._per_source: collections.Counter[str] = collections.Counter()
        # Those still in their handshake or head, oldest first.
        self._reading: dict[_Connection, None] = {}
        # Per source: connections opened, decaying by half every OPENED_HALF_LIFE_S, as of when.
        self._opened: dict[str, tuple[float, float]] = {}
        self._prune_at = MAX_SOURCES_REMEMBERED

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, connection: _Connection) -> str:
        """ "" when counted in (having closed one still reading if they were too many), else
        why not."""
        source = connection.source
        self._count_opened(source)
        if self._per_source[source] >= MAX_PER_SOURCE:
            return f"has {MAX_PER_SOURCE} connections open already"
        if len(self._open) >= MAX_CONNECTIONS:
            if not self._reading:
                return f"{MAX_CONNECTIONS} connections are open, every one of them past its request"
            # The first (oldest) of those whose source opened the most.
            victim = max(self._reading, key=lambda reading: self._opened[reading.source][0])
            self.leave(victim)
            victim.abort()
        self._open[connection] = None
        self._per_source[source] += 1
        self._reading[connection] = None
        return ""

    def _count_opened(self, source: str) -> None:
        now = time.monotonic()
        count, at = self._opened.get(source, (0.0, now))
        self._opened[source] = (count * 0.5 ** ((now - at) / OPENED_HALF_LIFE_S) + 1, now)
        if len(self._opened) > self._prune_at:
            # Those with a connection open, and those that opened several within a few half-lives.
            self._opened = {
                kept: (count, at)
                for kept, (count, at) in self._opened.items()
                if kept in self._per_source or kept == source or count * 0.5 ** ((now - at) / OPENED_HALF_LIFE_S) > 1
            }
            self._prune_at = max(MAX_SOURCES_REMEMBERED, 2 * len(self._opened))

    def abort(self) -> None:
        """Close every connection."""
        for connection in list(self._open):
            self.leave(connection)
            connection.abort()

    def heard(self, connection: _Connection) -> None:
        """Its request's head arrived: it is closed for nobody from here on."""
        self._reading.pop(connection, None)

    def leave(self, connection: _Connection) -> None:
        self._reading.pop(connection, None)
        if self._open.pop(connection, 0) is None:
            self._per_source[connection.source] -= 1
            if not self._per_source[connection.source]:
                del self._per_source[connection.source]


class _Refused(Exception):
    """An answer other than the metrics: its status, reason and extra headers."""

    def __init__(self, code: int, reason: str, headers: str = "") -> None:
        super().__init__(reason)
        self.code, self.reason, self.headers = code, reason, headers


REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}  # fmt: skip


class MetricsServer:
    """Serves `render`'s exposition (made at most once per `fresh_s`) at `path`; with `access`,
    over TLS (a self-signed certificate until `use_certificate` gives it one: the webhook's) to a
    bearer token it allows. A render that raises is answered 500. The liveness endpoint is one
    too (kube/liveness.py), plain and with a path of its own; `what` names the server in its
    log lines."""

    def __init__(
        self,
        render: Callable[[], bytes],
        access: MetricsAccess | None,
        fresh_s: float = FRESH_S,
        path: str = METRICS_PATH,
        what: str = "metrics",
    ) -> None:
        self.exposition = Exposition(render, fresh_s)
        self.access, self.path = access, path
        self._context: ssl.SSLContext | None = None
        if access is not None:
            self.use_certificate(self_signed(["localhost"], datetime.now(UTC)))
        self._connections = _Connections()
        self._serving: dict[asyncio.Task[None], _Connection] = {}
        self._warn = QuietLog(what, log).warn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._connections)

    def use_certificate(self, pair: CertificatePair) -> None:
        """Show `pair` from the next connection on (any thread may call it)."""
        # No client certificates are asked for: no CA store to load (create_default_context's).
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        load_pair(context, pair)
        self._context = context

    def start(self, host: str, port: int) -> int:
        """Listen on `host`:`port` (0: a free one) in a thread of its own; the port listened on."""
        listening: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(host, port, listening), name="metrics", daemon=True)
        self._thread.start()
        self.port = listening.result(STARTUP_TIMEOUT_S)
        return self.port

    def close(self) -> None:
        """Stop listening, close every connection, end the thread."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STARTUP_TIMEOUT_S)

    def _run(self, host: str, port: int, listening: concurrent.futures.Future[int]) -> None:
        loop = asyncio.new_event_loop()
        try:
            listener = socket.create_server((host, port), backlog=BACKLOG)
        except OSError as error:
            loop.close()
            listening.set_exception(error)
            return
        listener.setblocking(False)
        self._loop = loop
        loop.add_reader(listener.fileno(), self._accept, listener)
        listening.set_result(int(listener.getsockname()[1]))
        try:
            loop.run_forever()
        finally:
            loop.remove_reader(listener.fileno())
            listener.close()
            self._connections.abort()
            # And those that left the count (closing): each closes what it holds.
            for connection in self._serving.values():
                connection.abort()
            if self._serving:
                loop.run_until_complete(asyncio.wait(set(self._serving), timeout=CLOSE_TIMEOUT_S))
            loop.close()

    def _accept(self, listener: socket.socket) -> None:
        """Take the connections waiting, ACCEPTS_AT_ONCE at most before the loop serves the ones
        it holds again: one refused costs an accept and a close, no transport nor task."""
        for _ in range(ACCEPTS_AT_ONCE):
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                # Out of file descriptors, say: the listener stays readable, so it is left alone
                # for a moment (else the loop would spin on it).
                self._warn(("accept",), "cannot accept a connection: %s", error)
                loop = asyncio.get_running_loop()
                loop.remove_reader(listener.fileno())
                loop.call_later(ACCEPT_PAUSE_S, loop.add_reader, listener.fileno(), self._accept, listener)
                return
            connection = _Connection(sock, str(address[0]))
            why = self._connections.admit(connection)
            if why:
                self._warn(("busy", connection.source), "%s %s; closed a new one", connection.source, why)
                reset(sock)
                continue
            sock.setblocking(False)
            if self._context is not None:
                tls_connection_opened()
            task = asyncio.get_running_loop().create_task(self._serve(connection))
            connection.task = task
            self._serving[task] = connection
            task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task[None]) -> None:
        # A task cancelled before it began never closed its connection.
        self._serving.pop(task).close()

    async def _serve(self, connection: _Connection) -> None:
        source = connection.source
        writer: asyncio.StreamWriter | None = None
        try:
            try:
                writer, head = await asyncio.wait_for(self._head(connection), REQUEST_TIMEOUT_S)
            except TimeoutError:
                self._warn(("silent", source), "%s sent no request within %.0f s; closed", source, REQUEST_TIMEOUT_S)
                return
            finally:
                self._connections.heard(connection)
            if writer is None or head is None:
                return
            try:
                body, gzipped = await self._answer(head, source)
                encoding = "Content-Encoding: gzip\r\n" if gzipped else ""
                await self._write(writer, 200, f"Content-Type: {TEXT_FORMAT}\r\n{encoding}", body)
            except _Refused as refused:
                if refused.code != 404:
                    self._warn((refused.code, source), "refused a request from %s: %s", source, refused.reason)
                await self._write(writer, refused.code, refused.headers, f"{refused.reason}\n".encode())
            # What is written goes out before the connection closes (an abort would drop it).
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), WRITE_TIMEOUT_S)
        except (ConnectionError, ssl.SSLError, TimeoutError):
            pass  # gone, or too slow to read its answer
        finally:
            self._connections.leave(connection)
            connection.close()

    async def _head(self, connection: _Connection) -> tuple[asyncio.StreamWriter | None, bytes | None]:
        """The connection's writer (after the TLS handshake, with `access`) and its request's
        line and headers: None when the connection ended, b"" when it sent more than MAX_HEAD;
        None for both when it is not TLS."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MAX_HEAD, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, connection.sock, ssl=self._context)
        except (ssl.SSLError, ConnectionError, OSError):
            return None, None  # not TLS, or not one we speak
        connection.transport = transport
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        try:
            return writer, await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return writer, b""  # answered 431
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            return writer, None

    async def _answer(self, head: bytes, source: str) -> tuple[bytes, bool]:
        """The exposition (and whether gzipped) for the request `head`; _Refused."""
        if not head:
            raise _Refused(431, f"the request's head is longer than {MAX_HEAD} bytes")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            raise _Refused(400, "not an HTTP request")
        method, target, _ = parts
        if target.partition("?")[0] != self.path:
            raise _Refused(404, f"only {self.path} is served here")
        if method != "GET":
            raise _Refused(405, "GET only", "Allow: GET\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if self.access is not None:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            verdict = await self._check(token.strip() if scheme.lower() == "bearer" else "", source)
            if verdict.code != 200:
                challenge = 'WWW-Authenticate: Bearer realm="multiworld-operator"\r\n' if verdict.code == 401 else ""
                raise _Refused(verdict.code, verdict.reason, challenge)
        gzipped = "gzip" in headers.get("accept-encoding", "")
        try:
            return self.exposition.get(gzipped), gzipped
        except Exception as error:  # a collector's failure, or an unhealthy process: answered as one, said
            raise _Refused(500, f"{self.path} could not be rendered: {error}") from error

    async def _check(self, token: str, source: str) -> Verdict:
        assert self.access is not None
        try:
            return await asyncio.wait_for(self.access.check(token, source), CHECK_TIMEOUT_S)
        except TimeoutError:
            return Verdict(503, "the token's check took too long")

    async def _write(self, writer: asyncio.StreamWriter, code: int, headers: str, body: bytes) -> None:
        head = f"HTTP/1.1 {code} {REASONS[code]}\r\n{headers}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode() + body)
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
