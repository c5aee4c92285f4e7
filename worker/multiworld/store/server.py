"""The store server of a world's rank 0 and of a failure detector's beat store: torch's TCPStore
protocol (protocol.py), served by this library on one thread of its own, for torch's own
clients.

Not torch's server, because that one answers anything that reaches its port: every key to any
client that lists them (so a world's secret with them: world/rendezvous.py), any write to any
key (a member of one world could freeze the beat store the host's other worlds share:
rules.py), and as many connections and bytes as a client sends. It also names each connection
it accepts by a reverse DNS lookup, on the one thread that answers every client: while the
resolver takes its time (a dropped query costs its whole timeout, 5 s by default), the store's
every client waits, the heartbeats of the worlds it serves included. This one looks nothing up.

Its bounds (past one the connection is closed, said in the log once a minute per source and
kind): the requests' sizes (protocol.py), the bytes held (key_values.py), MAX_CONNECTIONS in
all and MAX_CONNECTIONS_PER_SOURCE from any one address other than this machine's,
VALIDATE_WITHIN_S for a new connection to say it is torch's client, no request read from a
client whose replies it does not take in (OUTBOX_HIGH), REQUESTS_A_TURN of a client's
pipelined requests answered before the others get their turn, and REQUESTS_PER_S from a source
(paced, not refused). No torch at import.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import selectors
import socket
import threading
import time
from collections.abc import Hashable
from datetime import timedelta
from typing import Any

from multiworld.per_source import Budgets, QuietLog
from multiworld.store.key_values import KeyValues
from multiworld.store.protocol import (
    STOP_WAITING,
    VALIDATION_MAGIC,
    WAIT_CANCELED,
    Query,
    Refused,
    Request,
    parse,
    ping_reply,
)
from multiworld.store.rules import KeyRules

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# A world of the largest spec (2048 ranks) holds a connection or two a member, a pod one or two
# for each of its processes.
MAX_CONNECTIONS = 8192
MAX_CONNECTIONS_PER_SOURCE = 32
VALIDATE_WITHIN_S = 10.0
# A client's replies not yet taken in, past which nothing more is read from it.
OUTBOX_HIGH = 1024 * 1024
ACCEPTS_AT_ONCE = 64
REQUESTS_A_TURN = 256
# Requests a second from any one source but this machine's own, and at once: past them its
# clients wait (PACE_S at a time), unread. A member's failure detector asks a few dozen a
# second; gloo's rendezvous of a world of the largest spec about two a peer, at once. The
# server is a Python thread: a flood unpaced would hold the GIL of rank 0's process, whose
# heartbeats then go silent for every world it is in.
REQUEST_BURST = 10_000
REQUESTS_PER_S = 2_000
PACE_S = 0.01
_RECV_BYTES = 256 * 1024
# How long a client of this process (its own) waits for an answer.
OWN_CLIENT_TIMEOUT = timedelta(seconds=60)


@functools.cache
def _own_family() -> socket.AddressFamily:
    """The family of this machine's own address (a pod's, from the hosts file the kubelet
    writes); IPv6 when it has none to name."""
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return socket.AF_INET6
    return socket.AF_INET if any(f == socket.AF_INET for f, *_ in found) else socket.AF_INET6


def listen_family(host: str) -> socket.AddressFamily:
    """The family a store listens on when its members reach it at `host`: an address's own,
    and for a name that of this machine's address."""
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return _own_family()
    return socket.AF_INET if version == 4 else socket.AF_INET6


def _source(address: Any) -> tuple[str, bool]:
    """A peer's address (an IPv4 peer of a dual-stack listener as IPv4) and whether it is this
    machine's own processes, as they connect (the loopback address: any other of 127/8 counts
    as a source of its own, as a test speaks from many)."""
    ip = ipaddress.ip_address(address[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), str(ip) in (LOOPBACK, "::1")


class _Client:
    def __init__(self, sock: socket.socket, source: str, local: bool) -> None:
        self.sock = sock
        self.source = source
        self.local = local
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.waiting = False
        self.opened = time.monotonic()
        self.events = 0


class StoreServer:
    """A store on `listener` (taken over), under `rules`, served until `close`."""

    def __init__(self, listener: socket.socket, rules: KeyRules) -> None:
        self.port: int = listener.getsockname()[1]
        self.rules = rules
        self._kv = KeyValues(rules)
        self._listener = listener
        listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        self._selector.register(self._wake_in, selectors.EVENT_READ)
        self._clients: set[_Client] = set()
        self._pending: set[_Client] = set()  # clients with requests left for the next turn
        self._unvalidated: set[_Client] = set()  # connections yet to say VALIDATE
        self._paced: dict[_Client, float] = {}  # clients past their source's budget: when to go on
        self._budgets = Budgets(REQUEST_BURST, REQUESTS_PER_S)
        self._expired = 0.0  # when _expire last looked (monotonic)
        self._per_source: dict[str, int] = {}
        self._warn = QuietLog(f"the {rules.name} on port {self.port}", log).warn
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"mw-store-{self.port}", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self._clients)

    def client(self, timeout: timedelta = OWN_CLIENT_TIMEOUT) -> Any:
        """A torch client of this store over loopback (this process's own)."""
        from torch.distributed import TCPStore

        return TCPStore(LOOPBACK, self.port, None, False, timeout)

    def close(self) -> None:
        """Stop serving: every client is cut off, the port let go."""
        self._closing.set()
        try:
            self._wake_out.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                for key, mask in self._selector.select(timeout=self._timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_in:
                        self._wake_in.recv(64)
                    else:
                        self._serve(key.data, mask)
                now = time.monotonic()
                for client in [c for c, at in self._paced.items() if at <= now]:
                    del self._paced[client]
                    self._take(client)
                for client in list(self._pending):
                    self._take(client)
                self._expire()
        except Exception:
            log.exception("the %s on port %d crashed", self.rules.name, self.port)
        finally:
            for client in list(self._clients):
                self._drop(client)
            self._selector.close()
            self._listener.close()
            self._wake_in.close()
            self._wake_out.close()

    def _timeout(self) -> float | None:
        """How long the loop may wait for an event: not at all with requests left from a turn,
        until the first paced client's next turn, a second while a connection has yet to say
        VALIDATE (`_expire` looks then), else until one comes (an idle store costs nothing)."""
        if self._pending:
            return 0.0
        if self._paced:
            return max(0.0, min(self._paced.values()) - time.monotonic())
        return 1.0 if self._unvalidated else None

    def _accept(self) -> None:
        for _ in range(ACCEPTS_AT_ONCE):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the next turn tries again
                self._warn(("accept", type(exc).__name__), "cannot accept: %s", exc)
                return
            source, local = _source(address)
            held = self._per_source.get(source, 0)
            if len(self._clients) >= MAX_CONNECTIONS or (not local and held >= MAX_CONNECTIONS_PER_SOURCE):
                what = "in all" if len(self._clients) >= MAX_CONNECTIONS else "from it"
                self._warn((source, "connections"), "refused a connection of %s: too many %s", source, what)
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client = _Client(sock, source, local)
            self._clients.add(client)
            self._unvalidated.add(client)
            self._per_source[source] = held + 1
            self._listen(client)

    def _serve(self, client: _Client, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(client)
            if client in self._clients and client.inbox:
                self._take(client)  # requests held back while its replies were not taken in
        if client in self._clients and mask & selectors.EVENT_READ:
            try:
                data = client.sock.recv(_RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._drop(client)
                return
            client.inbox += data
            self._take(client)

    def _take(self, client: _Client) -> None:
        """Answer the requests `client` sent, as far as they may be answered now, and at most
        REQUESTS_A_TURN of them: the rest on the loop's next turn, so that one client's
        pipelined requests keep no other waiting."""
        self._pending.discard(client)
        if client not in self._clients:
            return
        at, held_back = 0, False
        try:
            for _ in range(REQUESTS_A_TURN):
                if len(client.outbox) >= OUTBOX_HIGH:
                    held_back = True  # until its replies are taken in
                    break
                if client.waiting and client.inbox[at : at + 1] != bytes([Query.CANCEL_WAIT]):
                    break  # torch's client sends nothing else while it waits
                parsed = parse(client.inbox, at)
                if parsed is None:
                    break
                if not client.local and not self._budgets.take(client.source):
                    self._paced[client] = time.monotonic() + PACE_S
                    self._warn(
                        (client.source, "paced"), "paced %s: past %d requests a second", client.source, REQUESTS_PER_S
                    )
                    break
                request, at = parsed
                self._answer(client, request)
            else:
                self._pending.add(client)
        except Refused as refused:
            self._warn((client.source, refused.kind), "closed a connection of %s: %s", client.source, refused)
            self._drop(client)
            return
        finally:
            del client.inbox[:at]
        self._flush(client)
        if held_back and client in self._clients and len(client.outbox) < OUTBOX_HIGH:
            self._pending.add(client)  # its replies went at once: no write event will come

    def _answer(self, client: _Client, request: Request) -> None:
        query = request.query
        if client in self._unvalidated:
            if query is not Query.VALIDATE or request.number != VALIDATION_MAGIC:
                raise Refused("junk", "a connection that does not begin as torch's store client does")
            self._unvalidated.discard(client)
        elif query is Query.VALIDATE:
            raise Refused("junk", "a second VALIDATE")
        elif query is Query.PING:
            client.outbox += ping_reply(request.number)
        elif query is Query.WAIT:
            if self._kv.wait(client, request.keys):
                client.outbox += STOP_WAITING
            else:
                client.waiting = True
        elif query is Query.CANCEL_WAIT:
            self._kv.cancel(client)
            client.waiting = False
            client.outbox += WAIT_CANCELED
        else:
            reply, woken = self._kv.answer(request, client.source, local=client.local)
            if reply is not None:
                client.outbox += reply
            self._wake(woken)

    def _wake(self, woken: list[Hashable]) -> None:
        for waiter in woken:
            assert isinstance(waiter, _Client)
            waiter.waiting = False
            waiter.outbox += STOP_WAITING
            self._flush(waiter)
            if waiter.inbox:
                self._pending.add(waiter)

    def _flush(self, client: _Client) -> None:
        if client.outbox:
            try:
                sent = client.sock.send(client.outbox)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(client)
                return
            del client.outbox[:sent]
        self._listen(client)

    def _listen(self, client: _Client) -> None:
        # Nothing more is read while its requests wait for their turn or its replies pile up.
        reads = len(client.outbox) < OUTBOX_HIGH and client not in self._pending and client not in self._paced
        events = (selectors.EVENT_READ if reads else 0) | (selectors.EVENT_WRITE if client.outbox else 0)
        if events == client.events:
            return
        if not client.events:
            self._selector.register(client.sock, events, client)
        elif events:
            self._selector.modify(client.sock, events, client)
        else:
            self._selector.unregister(client.sock)
        client.events = events

    def _expire(self) -> None:
        """Close the connections that did not say they are torch's client in time (looked
        over once a second: the loop turns once a request)."""
        now = time.monotonic()
        if now - self._expired < 1.0:
            return
        self._expired = now
        late = now - VALIDATE_WITHIN_S
        for client in [c for c in self._unvalidated if c.opened < late]:
            self._warn((client.source, "silent"), "closed a connection of %s: silent", client.source)
            self._drop(client)

    def _drop(self, client: _Client) -> None:
        if client not in self._clients:
            return
        self._clients.discard(client)
        self._pending.discard(client)
        self._unvalidated.discard(client)
        self._paced.pop(client, None)
        self._kv.cancel(client)
        left = self._per_source[client.source] - 1
        if left:
            self._per_source[client.source] = left
        else:
            del self._per_source[client.source]
        if client.events:
            self._selector.unregister(client.sock)
        client.sock.close()


def serve(host: str, port: int, rules: KeyRules) -> StoreServer:
    """A store on `port` (0: one the kernel picks) of every interface, for members that reach
    it at `host`, under `rules`. OSError when the port cannot be had."""
    if listen_family(host) == socket.AF_INET:
        listener = socket.create_server(("0.0.0.0", port))
    else:
        listener = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return StoreServer(listener, rules)
