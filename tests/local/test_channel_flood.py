"""A flood of connections keeps no worker from its table (issue 32, finding 2).

A real ChannelServer serves on loopback in its own thread; a flooder that is not ours, a
separate process with raw sockets, holds as many connections as it can from one source address
or from many (127.0.0.2 and up: every 127/8 address is this machine's), silent, and opens a new
one the moment one is closed. A real worker's channel (StreamChannel) connects meanwhile, again
and again: each must get its table within a couple of seconds, where a flood that filled the
greeting slots used to shut it out for HELLO_TIMEOUT_S at a time.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from multiworld.channels.stream import StreamChannel
from multiworld.contract import WorldEntry, WorldTable
from multiworld_operator import channel_server
from multiworld_operator.channel_server import ChannelServer

T = TypeVar("T")

# The flooder: argv = port, number of sources, connections per source. Silent connections, each
# replaced at once when the server closes it; it counts the connections it opened.
FLOODER = r"""
import selectors, socket, sys
port, sources, per_source = (int(a) for a in sys.argv[1:4])
selector = selectors.DefaultSelector()
opened = 0

def open_one(source):
    global opened
    sock = socket.socket()
    sock.setblocking(False)
    sock.bind((source, 0))
    try:
        sock.connect(("127.0.0.1", port))
    except BlockingIOError:
        pass
    selector.register(sock, selectors.EVENT_READ, source)
    opened += 1

for index in range(sources):
    for _ in range(per_source):
        open_one(f"127.0.0.{2 + index}")
print("flooding", flush=True)
while True:
    for key, _ in selector.select(0.5):
        try:
            data = key.fileobj.recv(4096)
        except OSError:
            data = b""
        if not data:
            selector.unregister(key.fileobj)
            key.fileobj.close()
            open_one(key.data)
"""
# How long a worker may wait for its table under a flood: a connection of the worker closed by
# the flood costs it one retry (half a second); one kept out by it cost HELLO_TIMEOUT_S or more.
TABLE_WITHIN_S = 5.0
# Worker connections measured per flood.
ATTEMPTS = 5

TABLE = WorldTable(
    worlds=[WorldEntry(name="w", epoch=1, host="127.0.0.1", port=29500, backend="gloo", pods=["worker", "peer"])]
)


class ServerThread:
    """A ChannelServer on its own event loop, as the operator runs it, with a table published."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = ChannelServer(lambda *_: None, lambda *_: None)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self._call(self._start())

    async def _start(self) -> int:
        port = await self.server.start("127.0.0.1", 0)
        self.server.publish(TABLE)
        return port

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    async def _stop(self) -> None:
        await self.server.close()
        # The flood's connections still greeting, closed with their tasks.
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        self._call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def server() -> Iterator[ServerThread]:
    served = ServerThread()
    yield served
    served.close()


def flood(port: int, sources: int, per_source: int) -> subprocess.Popen[str]:
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER, str(port), str(sources), str(per_source)], stdout=subprocess.PIPE, text=True
    )
    assert flooder.stdout is not None and flooder.stdout.readline() == "flooding\n"
    return flooder


def seconds_to_table(port: int) -> float:
    """How long a real worker's channel takes from its start to its table."""
    got = threading.Event()
    channel = StreamChannel("127.0.0.1", port, "worker")
    started = time.monotonic()
    channel.start(lambda table: got.set() if table.worlds else None)
    try:
        if not got.wait(TABLE_WITHIN_S):
            return float("inf")
        return time.monotonic() - started
    finally:
        channel.close()


@pytest.mark.parametrize(
    ("sources", "per_source"),
    [(1, 2000), (100, channel_server.MAX_GREETING_PER_SOURCE)],
    ids=["one-source", "many-sources"],
)
def test_a_flood_of_silent_connections_keeps_no_worker_from_its_table(
    server: ServerThread, sources: int, per_source: int
) -> None:
    """From one source, far more connections than the server lets greet; from many, more in all
    than may read a hello at once, each replaced as it is closed (the server then closes the
    oldest for each new one: the flood churns at full speed). A worker gets its table each time."""
    assert sources * per_source > channel_server.MAX_READING
    flooder = flood(server.port, sources, per_source)
    try:
        waits = [seconds_to_table(server.port) for _ in range(ATTEMPTS)]
        assert flooder.poll() is None, "the flooder stopped"
    finally:
        flooder.kill()
        flooder.wait()
    print(f"\nflood of {sources} x {per_source}: a worker's table after {', '.join(f'{w:.2f}' for w in waits)} s")
    assert max(waits) < TABLE_WITHIN_S, waits
