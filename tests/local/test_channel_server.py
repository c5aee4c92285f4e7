"""The platform's end of the worker channel, a real ChannelServer on loopback with real
sockets: what arrives on a connection is its speaker's, stamped by the platform's clock; and
what one connection may cost the platform (the operator serves it to the whole cluster): a
hello within its deadline, a bounded number of connections greeting at once, and a message rate
per connection."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from multiworld import per_source
from multiworld.contract import BrokenWorldReport, ChannelMessage, Hello, WorkerStatus
from multiworld_operator import channel_server
from multiworld_operator.channel_server import ChannelServer, Speaker

# Long enough for a hello on a loaded machine, short enough for a test to wait out.
HELLO_TIMEOUT_S = 1.0


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> list[ChannelMessage]:
    """What the server sent before it closed the connection, which it must do within `seconds`."""
    messages = []
    async with asyncio.timeout(seconds):
        try:
            while line := await reader.readline():
                messages.append(ChannelMessage.decode(line))
        except ConnectionResetError:
            pass  # closed with what we sent unread
    return messages


def status(pod: str, step: int) -> ChannelMessage:
    """A status unlike the one before it."""
    return ChannelMessage(status=WorkerStatus(pod=pod, joined={"w": step}, started=datetime.now(UTC)))


def test_a_report_is_its_speakers_and_dated_when_the_platform_heard_it() -> None:
    """Whatever pod and time a report claims: the connection's pod, and the platform's clock
    (it compares reports with its own sightings of pods; a worker's clock may be skewed)."""

    async def scenario() -> None:
        heard: list[tuple[Speaker, BrokenWorldReport]] = []
        server = ChannelServer(lambda speaker, report: heard.append((speaker, report)), lambda *_: None)
        port = await server.start()
        reader, writer = await connect(port)
        writer.write(ChannelMessage(hello=Hello(pod="honest")).encode())
        long_ago = datetime(2000, 1, 1, tzinfo=UTC)
        claimed = BrokenWorldReport(world="w", epoch=1, reason="x", pod="someone-else", time=long_ago)
        before = datetime.now(UTC)
        writer.write(ChannelMessage(report=claimed).encode())
        await writer.drain()
        async with asyncio.timeout(5):
            while not heard:
                await asyncio.sleep(0.01)
        ((speaker, report),) = heard
        assert speaker.pod == report.pod == "honest"
        assert before <= report.time <= datetime.now(UTC)
        writer.close()
        await server.close()

    asyncio.run(scenario())


@pytest.fixture
def short_hello(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel_server, "HELLO_TIMEOUT_S", HELLO_TIMEOUT_S)


def test_a_connection_without_a_hello_is_closed_at_its_deadline(short_hello: None) -> None:
    async def scenario() -> None:
        server = ChannelServer(lambda *_: None, lambda *_: None)
        port = await server.start()
        reader, writer = await connect(port)
        assert await closed_within(reader, HELLO_TIMEOUT_S + 5) == []
        writer.close()
        await server.close()

    asyncio.run(scenario())


async def connect_from(source: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection from `source` (any 127/8 address is this machine's)."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


def test_one_source_may_greet_on_so_many_connections_at_once(short_hello: None) -> None:
    """MAX_GREETING_PER_SOURCE silent connections from one source: one more from there is closed
    at once, while a worker from another source is served."""

    async def scenario() -> None:
        server = ChannelServer(lambda *_: None, lambda *_: None)
        port = await server.start()
        silent = [await connect_from("127.0.0.2", port) for _ in range(channel_server.MAX_GREETING_PER_SOURCE)]
        await asyncio.sleep(0.2)  # the server took each of them
        reader, writer = await connect_from("127.0.0.2", port)
        writer.write(ChannelMessage(hello=Hello(pod="late")).encode())
        assert await closed_within(reader, HELLO_TIMEOUT_S / 2) == []
        reader, writer = await connect_from("127.0.0.3", port)
        writer.write(ChannelMessage(hello=Hello(pod="served")).encode())
        await writer.drain()
        await asyncio.sleep(0.3)
        assert not reader.at_eof()
        assert not any(silent_reader.at_eof() for silent_reader, _ in silent)
        for _, silent_writer in silent:
            silent_writer.close()
        writer.close()
        await server.close()

    asyncio.run(scenario())


def test_past_so_many_connections_reading_a_hello_the_oldest_is_closed() -> None:
    """MAX_READING silent connections from many sources, then one more: the oldest is closed to
    let it in, and the others stay (until their deadline, the default here: opening them all
    may take more than a short one on a loaded machine)."""

    async def scenario() -> None:
        server = ChannelServer(lambda *_: None, lambda *_: None)
        port = await server.start()
        per_source = channel_server.MAX_GREETING_PER_SOURCE
        sources = [f"127.0.1.{n}" for n in range(1, channel_server.MAX_READING // per_source + 1)]
        silent = [await connect_from(source, port) for source in sources for _ in range(per_source)]
        await asyncio.sleep(0.2)
        assert not any(silent_reader.at_eof() for silent_reader, _ in silent)
        newest = await connect_from("127.0.0.2", port)
        assert await closed_within(silent[0][0], 2) == []
        await asyncio.sleep(0.2)
        assert not any(silent_reader.at_eof() for silent_reader, _ in [*silent[1:], newest])
        for _, silent_writer in [*silent, newest]:
            silent_writer.close()
        await server.close()

    asyncio.run(scenario())


def test_a_connection_over_its_message_rate_is_refused_and_closed() -> None:
    async def scenario() -> None:
        taken: list[Speaker] = []
        server = ChannelServer(lambda *_: None, lambda speaker, _: taken.append(speaker))
        port = await server.start()
        reader, writer = await connect(port)
        writer.write(ChannelMessage(hello=Hello(pod="chatty")).encode())
        sent = channel_server.MESSAGE_BURST * 5
        writer.write(b"".join(status("chatty", step).encode() for step in range(sent)))
        await writer.drain()
        messages = await closed_within(reader, 10)
        refusals = [m.refused for m in messages if m.refused is not None]
        assert len(refusals) == 1 and "pod chatty sent more than" in refusals[0]
        assert channel_server.MESSAGE_BURST <= len(taken) < sent
        writer.close()
        await server.close()

    asyncio.run(scenario())


def test_a_connection_refused_again_and_again_is_logged_once_with_a_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anything in the cluster may connect as often as it likes: each refusal is told to the
    connection, but the operator's log says it once per source and kind (with a count of those
    held back when it says it again), not once per connection."""
    monkeypatch.setattr(per_source, "LOG_EVERY_S", 0.5)

    async def scenario() -> None:
        server = ChannelServer(lambda *_: None, lambda *_: None)
        port = await server.start()

        async def refused_once() -> None:
            reader, writer = await connect(port)
            writer.write(ChannelMessage(status=WorkerStatus(pod="junk")).encode())
            await writer.drain()
            (message,) = await closed_within(reader, 10)
            assert message.refused is not None and "must be a hello" in message.refused
            writer.close()

        for _ in range(20):
            await refused_once()
        await asyncio.sleep(0.6)
        await refused_once()
        await server.close()

    with caplog.at_level("WARNING", logger=channel_server.__name__):
        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records if "refused a connection from 127.0.0.1" in r.getMessage()]
    assert len(said) == 2, said
    assert "more like it" not in said[0] and "(19 more like it in the last" in said[1], said
