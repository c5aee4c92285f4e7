"""What one pod may cost the platform's end of the worker channel (issue 32 finding 4), each
bound driven past by a raw TCP client that speaks the protocol by hand (not the worker's
StreamChannel, which keeps to the bounds): a line longer than the longest a worker sends, a
pod's messages and bytes over all its connections (a reconnection does not refill them), and a
worker that stops reading what it is sent."""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime

import pytest

from multiworld.contract import ChannelMessage, Hello, WorkerStatus, WorldEntry, WorldTable
from multiworld_operator import channel_server
from multiworld_operator.channel_server import LOCAL, ChannelServer, Speaker
from multiworld_operator.spec.limits import MAX_WORLDS_PER_POD
from tests.support.limits_support import worker_line


class RawWorker:
    """One connection, written and read as bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, pod: str, receive_buffer: int | None = None) -> RawWorker:
        sock = socket.socket()
        if receive_buffer is not None:  # set before connecting: the window it offers
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=64 * 1024 * 1024)
        writer.write(ChannelMessage(hello=Hello(pod=pod)).encode())
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        try:
            await self.writer.drain()
        except ConnectionError:
            pass  # refused meanwhile: what it was told is still to be read

    async def refusal(self, seconds: float = 10) -> str | None:
        """What the platform said before it closed the connection: its refusal, if it sent one."""
        async with asyncio.timeout(seconds):
            try:
                while line := await self.reader.readline():
                    message = ChannelMessage.decode(line)
                    if message.refused is not None:
                        return message.refused
            except ConnectionResetError:
                pass
        return None

    def close(self) -> None:
        self.writer.close()


def status(pod: str, step: int, worlds: int = 1) -> bytes:
    """A status unlike the one before it, naming `worlds` worlds (names of 63 characters)."""
    names = [f"w{i:04d}".ljust(63, "x") for i in range(worlds)]
    return ChannelMessage(
        status=WorkerStatus(pod=pod, joined=dict.fromkeys(names, step), started=datetime.now(UTC))
    ).encode()


class Heard:
    def __init__(self) -> None:
        self.statuses: list[Speaker] = []

    def server(self) -> ChannelServer:
        return ChannelServer(lambda *_: None, lambda speaker, _: self.statuses.append(speaker))


def test_a_line_longer_than_any_worker_sends_closes_the_connection() -> None:
    """Twice the longest message a worker sends (its status in MAX_WORLDS_PER_POD worlds, every
    name and number at its longest) is past the bound: closed unread."""
    longest = worker_line(MAX_WORLDS_PER_POD)
    assert longest <= channel_server.MAX_LINE < 2 * longest

    async def scenario() -> None:
        heard = Heard()
        server = heard.server()
        port = await server.start()
        worker = await RawWorker.open(port, "long")
        line = status("long", 1)
        # Twice the longest a worker sends: JSON padded with spaces.
        await worker.send(line[:-2] + b" " * (2 * longest - len(line)) + line[-2:])
        assert await worker.refusal() is None  # closed, nothing said
        assert heard.statuses == []
        worker.close()
        await server.close()

    asyncio.run(scenario())


def test_a_pods_message_budget_is_not_refilled_by_reconnecting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod refused for its message rate is refused again at once on a new connection: its
    budget is the pod's, not the connection's."""
    monkeypatch.setattr(channel_server, "MESSAGES_PER_S", 1.0)

    async def scenario() -> None:
        heard = Heard()
        server = heard.server()
        port = await server.start()
        burst = channel_server.MESSAGE_BURST
        first = await RawWorker.open(port, "chatty")
        await first.send(b"".join(status("chatty", step) for step in range(burst + 10)))
        assert "pod chatty sent more than" in str(await first.refusal())
        assert len(heard.statuses) == burst
        second = await RawWorker.open(port, "chatty")
        await second.send(b"".join(status("chatty", step) for step in range(20)))
        assert "pod chatty sent more than" in str(await second.refusal())
        assert len(heard.statuses) <= burst + 2  # what a second or two refilled
        other = await RawWorker.open(port, "quiet")  # another pod's budget is its own
        await other.send(status("quiet", 1))
        async with asyncio.timeout(10):
            while not any(s.pod == "quiet" for s in heard.statuses):
                await asyncio.sleep(0.01)
        for worker in (first, second, other):
            worker.close()
        await server.close()

    asyncio.run(scenario())


def test_a_pods_bytes_are_bounded_over_its_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few messages, each as large as a worker's largest: past the byte burst the pod is
    refused, and a new connection does not refill it."""
    monkeypatch.setattr(channel_server, "BYTE_BURST", 1024 * 1024)
    monkeypatch.setattr(channel_server, "BYTES_PER_S", 1024)

    async def scenario() -> None:
        heard = Heard()
        server = heard.server()
        port = await server.start()
        large = [status("bulky", step, worlds=800) for step in range(40)]
        assert all(len(line) < channel_server.MAX_LINE for line in large)
        fits = channel_server.BYTE_BURST // len(large[0])
        assert fits < channel_server.MESSAGE_BURST  # the bytes bound it, not the count
        first = await RawWorker.open(port, "bulky")
        await first.send(b"".join(large))
        assert "pod bulky sent more than" in str(await first.refusal())
        assert len(heard.statuses) == fits
        second = await RawWorker.open(port, "bulky")
        await second.send(b"".join(large[:4]))
        assert "pod bulky sent more than" in str(await second.refusal())
        assert len(heard.statuses) == fits
        first.close()
        second.close()
        await server.close()

    asyncio.run(scenario())


def _table(pod: str, revision: int) -> WorldTable:
    """A table of 40 worlds of `pod` with 60 pods each, new at each revision (about 200 KiB for it)."""
    pods = [pod, *(f"p{i:02d}".ljust(63, "x") for i in range(59))]
    worlds = [
        WorldEntry(name=f"w{i:02d}", epoch=revision, host="h", port=1, pods=pods, instances=dict.fromkeys(pods, 1))
        for i in range(40)
    ]
    return WorldTable(revision=revision, worlds=worlds)


def test_a_worker_that_reads_nothing_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """Tables written to a connection whose worker reads nothing pile up in the platform's
    memory: past MAX_UNSENT the connection is dropped, and said once."""

    async def scenario() -> None:
        heard = Heard()
        server = heard.server()
        port = await server.start()
        worker = await RawWorker.open(port, "deaf", receive_buffer=4096)
        await worker.send(status("deaf", 1))
        async with asyncio.timeout(10):
            while not heard.statuses:
                await asyncio.sleep(0.01)
        size = len(ChannelMessage(table=_table("deaf", 1)).encode())
        # Far more than the kernel's buffers on both ends hold, and MAX_UNSENT beyond.
        for revision in range(1, 64 * 1024 * 1024 // size):
            server.publish(_table("deaf", revision), LOCAL)
            await asyncio.sleep(0)
            if "left" in caplog.text:
                break
        assert "pod deaf (127.0.0.1:" in caplog.text and "bytes of tables unread" in caplog.text
        worker.close()
        await server.close()

    with caplog.at_level("WARNING", logger=channel_server.__name__):
        asyncio.run(scenario())
