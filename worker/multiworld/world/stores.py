"""The per-world TCPStore: rank 0 serves it, every member connects its own clients.

A process keeps one store server per port (and so per world) for as long as it holds the
world, so a rank 0 that survives a failure serves the later epochs too; the epoch prefix
(`<world>/<epoch>/<secret>/`: contract.store_prefix) keeps older epochs out, and any process
not handed the epoch's secret: the server (store/server.py) authenticates nobody, but lists no
keys, so none can be named without it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore

from multiworld.errors import JoinCancelled, JoinTimedOut, StoreLost, WorldJoinError
from multiworld.log_context import WorldLog
from multiworld.store import server as store_server
from multiworld.store.rules import WORLD_STORE
from multiworld.store.server import LOOPBACK

log = logging.getLogger(__name__)

# Probing for the store server: short attempts, so that a cancelled join notices soon.
_PROBE_TIMEOUT = 0.5
_PROBE_INTERVAL = 0.05

_servers: dict[int, tuple[str, store_server.StoreServer]] = {}
# How often each port's store was asked for (see stop_serving).
_asked: dict[int, int] = {}
_servers_lock = threading.Lock()


def serve(world: str, host: str, port: int) -> None:
    """Make sure this process serves the store of `world` on `port` (every interface), whose
    members reach it at `host`."""
    with _servers_lock:
        _asked[port] = _asked.get(port, 0) + 1
        held = _servers.get(port)
        if held is not None:
            if held[0] != world:
                raise WorldJoinError(
                    f"cannot serve the store of world {world!r} on port {port}: "
                    f"this process already serves world {held[0]!r} there"
                )
            return
        try:
            server = store_server.serve(host, port, WORLD_STORE)
        except Exception as exc:
            raise WorldJoinError(f"cannot serve the store of world {world!r} on port {port}: {exc}") from exc
        _servers[port] = (world, server)
        WorldLog(log, world).debug("serving its store on port %d", port)


def asked(port: int) -> int:
    """How often the store on `port` was asked for so far: a mark for stop_serving."""
    with _servers_lock:
        return _asked.get(port, 0)


def stop_serving(world: str, port: int, *, unless_asked_since: int | None = None) -> None:
    """Stop serving `world`'s store (when the world is left for good); with
    `unless_asked_since` (a mark from `asked`), only if nobody asked for it since then: a world
    left and joined again at once goes on with the same store."""
    with _servers_lock:
        held = _servers.get(port)
        if held is None or held[0] != world:
            return
        if unless_asked_since is not None and _asked.get(port, 0) != unless_asked_since:
            return
        del _servers[port]
    held[1].close()
    WorldLog(log, world).debug("stopped serving its store on port %d", port)


def open_client(
    world: str, rank: int, host: str, port: int, *, deadline: float, cancelled: threading.Event, wait_timeout: float
) -> TCPStore:
    """A client of the world's store for the member of rank `rank`. Rank 0 serves the store on
    every interface and reaches it over loopback, so it never waits for its own name to resolve
    (a new pod's DNS record can lag)."""
    if rank == 0:
        serve(world, host, port)
    return connect(
        world, LOOPBACK if rank == 0 else host, port, deadline=deadline, cancelled=cancelled, wait_timeout=wait_timeout
    )


def connect(
    world: str, host: str, port: int, *, deadline: float, cancelled: threading.Event, wait_timeout: float
) -> TCPStore:
    """A new client connection to the world's store, retried until `deadline`.

    A plain socket probes first: it is silent (TCPStore logs every failed attempt) and can be
    called off between short attempts.
    """
    while True:
        if cancelled.is_set():
            raise JoinCancelled(world)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise JoinTimedOut(f"cannot reach the store of world {world!r} at {host}:{port}")
        try:
            socket.create_connection((host, port), timeout=min(remaining, _PROBE_TIMEOUT)).close()
        except OSError:
            cancelled.wait(_PROBE_INTERVAL)
            continue
        try:
            client = TCPStore(host, port, None, False, timedelta(seconds=max(remaining, 1.0)))
        except Exception as exc:
            raise StoreLost(f"cannot reach the store of world {world!r} at {host}:{port}: {exc}") from exc
        client.set_timeout(timedelta(seconds=wait_timeout))
        return client
