"""The platform's end of the worker channel (both platforms): a TCP server speaking
`ChannelMessage` lines (multiworld.channels.stream is the worker's end).

Each connection opens with a hello, which `authenticate` turns into a `Speaker` (the local
runner trusts its own processes; the operator checks the pod's token: kube/workers/worker_identity.py)
or refuses, with a reason sent back before the connection closes. From then on, what arrives on
it is that speaker's, whatever the messages claim (their `pod` is overwritten, and a report's
`time` is when the platform heard it, by the platform's clock), and the server
pushes that pod its part of its group's world table (the entries of its own worlds: a change
elsewhere sends it nothing). A group is one MultiWorld.

Anything in the cluster may connect, so what each source may cost is bounded (docs/security.md
has the figures): a hello within HELLO_TIMEOUT_S, at most MAX_GREETING_PER_SOURCE connections
greeting at once per source address, at most MAX_READING connections in all still reading their
hello (past it the oldest of them is closed, so that no flood, from one source or many, holds the
door shut: a worker sends its hello as it connects, and the flood's connections are older),
hellos per source address (each may cost the platform a check: a TokenReview), lines up
to MAX_LINE bytes, messages and bytes per pod whatever its connections (a reconnection does
not refill them), and what the platform has written to a connection and the worker has not
read (past MAX_UNSENT the connection is dropped). Past a bound the connection is refused (the
worker is told why, and reconnects more slowly), said in the log once a minute per source.

A worker's host that goes silent (powered off, cut off the network) closes nothing: no FIN, no
RST ever comes. The server has the kernel probe each worker's connection (TCP keepalive, and a
user timeout for what it sends): a connection that gets no acknowledgement for LOST_AFTER_S ends
with ETIMEDOUT, and `on_lost` hears of its speaker. The kernel, not the worker's process,
answers the probes: a frozen or busy process is not lost, a process that exits closes its
connection; only a host that stopped answering is. A connection whose instance is no longer its
pod's (`keep_only`: replaced, most often named by its peers a second after its host went silent)
is retired rather than closed: it gets nothing more and what it sends is read and dropped, but it
is probed on for RETIRED_PROBE_S, so that `on_lost` still says whether its host was lost (whose
node the platform then avoids) or its process merely ended (the connection closes first). A
retired connection is also sent an empty line at once (the worker skips blank lines): a host that
acknowledges none of it within ANSWER_WITHIN_S is lost then, not LOST_AFTER_S later, so that the
replacement made at the same moment, which the scheduler may have put on that node (it looks
Ready and empty), is made again elsewhere within a second or so.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from multiworld.contract import BrokenWorldReport, ChannelMessage, Hello, WorkerStatus, WorldTable
from multiworld.per_source import Budgets, QuietLog
from multiworld_operator.spec.limits import MAX_WORLDS_PER_POD

log = logging.getLogger(__name__)

# The local runner serves one MultiWorld: every speaker is in this group.
LOCAL: Hashable = ""
KIB, MIB = 1 << 10, 1 << 20
# The longest message: a longer line closes the connection. A worker's longest, the status of
# a pod in MAX_WORLDS_PER_POD worlds with every name and number at its longest, is 64 KiB
# (tests/support/limits_support.py's worker_line).
MAX_LINE = 128 * KIB
# A connection must prove who speaks within this long, and only so many may be trying at once:
# silent, slow or junk connections (anything in the cluster may connect) cost a bounded amount.
HELLO_TIMEOUT_S = 10.0
# A worker has one connection at a time (a reconnection follows the close of the last): a source
# holding more is not a worker, or a node's worth of them starting at once.
MAX_GREETING_PER_SOURCE = 8
# Connections the kernel holds for the server to accept: a flood that fills this queue makes
# the kernel drop a worker's connection attempt, which it then retries only after a second.
BACKLOG = 4096
# Connections still reading their hello, each holding up to MAX_LINE of buffer: 32 MiB at most.
MAX_READING = 256
# What one pod may send, over all its connections: a burst, then a steady rate, of messages
# and of bytes. A worker sends a status per change (a world joined, a table applied) and a
# report per world it saw break (on connecting: its status and a report per world, twice over
# fits the burst). The pod in most worlds of the largest accepted spec sends 7.8 MiB of
# statuses while it joins its 200 worlds again (names of 63 characters); past the burst its
# connection is refused, and it sends its latest status when it reconnects.
MESSAGE_BURST = 2 * (MAX_WORLDS_PER_POD + 1)
MESSAGES_PER_S = 50.0
BYTE_BURST = 8 * MIB
BYTES_PER_S = 256 * KIB
# Hellos per source address, which may each cost the platform a check of the pod's token: a
# worker says one per connection, and reconnects at most twice a second.
HELLO_BURST = 10
HELLOS_PER_S = 1.0
# What a connection may hold of the tables written to it and not yet read by its worker: the
# largest part of the largest accepted spec's table one pod gets is 220 KiB. Past it the
# connection is dropped (a worker that stops reading would keep every table in the platform's
# memory); the worker reconnects and gets the table anew.
MAX_UNSENT = 1 * MIB
# How long a refusal may take to write before the connection is closed without it.
REFUSE_WRITE_S = 1.0
# A worker's connection that gets no TCP acknowledgement for this long is lost with its host: a
# keepalive probe after KEEPALIVE_IDLE_S of quiet, then one a second (the kernel answers them,
# whatever its process does); what the server sends gives up after the same time unacknowledged.
LOST_AFTER_S = 5
KEEPALIVE_IDLE_S = 2
KEEPALIVE_INTERVAL_S = 1
# How long a retired connection (its instance replaced) is kept, probed, before it is closed.
RETIRED_PROBE_S = LOST_AFTER_S + 2.0
# How long a retired connection's host has to acknowledge the empty line it is sent: a live
# host's kernel answers in milliseconds, a frozen or busy process's too, and a segment or ACK
# lost on the way is sent again (the shortest retransmission timeout is 0.2 s) well within it.
ANSWER_WITHIN_S = 1.0


@dataclass(frozen=True)
class Speaker:
    """Who is at the other end of one connection: a pod (and its uid, on Kubernetes) of `group`."""

    group: Hashable
    pod: str
    uid: str = ""


class Refused(Exception):
    """A hello that does not prove who speaks; the message is sent to the worker."""


# A hello and the address it came from -> who speaks; Refused.
Authenticate = Callable[[Hello, str], Awaitable[Speaker]]


def local_url(port: int) -> str:
    """What the local runner's processes are told to connect to (MULTIWORLD_TABLE)."""
    return f"local://127.0.0.1:{port}"


async def trust_hello(hello: Hello, source: str) -> Speaker:
    """The local runner's processes are the user's own: a hello is who it says."""
    return Speaker(LOCAL, hello.pod)


class ChannelServer:
    def __init__(
        self,
        on_report: Callable[[Speaker, BrokenWorldReport], None],
        on_status: Callable[[Speaker, WorkerStatus], None],
        authenticate: Authenticate = trust_hello,
        on_lost: Callable[[Speaker], None] | None = None,
    ) -> None:
        self._on_report = on_report
        self._on_status = on_status
        self._on_lost = on_lost
        self._authenticate = authenticate
        self._tables: dict[Hashable, WorldTable] = {}
        self._writers: dict[tuple[Hashable, str], asyncio.StreamWriter] = {}
        # Per pod: the instance (uid) whose connection is in `_writers`.
        self._uids: dict[tuple[Hashable, str], str] = {}
        # Per pod: the entries last sent to it.
        self._sent: dict[tuple[Hashable, str], WorldTable] = {}
        # Connections of instances no longer their pod's, probed until they end (at most
        # RETIRED_PROBE_S): their speakers.
        self._retired: dict[asyncio.StreamWriter, Speaker] = {}
        self._server: asyncio.Server | None = None
        # Connections that have not proven who speaks yet.
        self._greeters = _Greeters()
        # What each pod may still send, by (group, pod).
        self._messages = Budgets(MESSAGE_BURST, MESSAGES_PER_S)
        self._bytes = Budgets(BYTE_BURST, BYTES_PER_S)
        self._warn = QuietLog("channel", log).warn

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on `host`:`port` (0: a free port); the port listened on."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_LINE, backlog=BACKLOG)
        listened: int = self._server.sockets[0].getsockname()[1]
        return listened

    def publish(self, table: WorldTable, group: Hashable = LOCAL) -> None:
        """Send each connected pod of `group` its part of `table` where that part changed (and
        later ones theirs on hello)."""
        if self._tables.get(group) == table:
            return
        self._tables[group] = table
        for (pod_group, pod), writer in list(self._writers.items()):
            if pod_group == group:
                self._send(group, pod, writer)

    def forget(self, group: Hashable) -> None:
        """The group is gone (its MultiWorld deleted): close its connections, drop its table."""
        self._tables.pop(group, None)
        self.keep_only(group, lambda pod, uid: False, probe=False)
        for writer in [writer for writer, speaker in self._retired.items() if speaker.group == group]:
            writer.close()

    def keep_only(self, group: Hashable, current: Callable[[str, str], bool], *, probe: bool = True) -> None:
        """Retire each connection of `group` whose instance, `current(pod, uid)` says, is no longer
        its pod's (deleted, being deleted, replaced), or close it unless `probe`. A table is sent by
        pod name: without this, such an instance would get the entries of the pod's next instance,
        and with them each world's secret at an epoch it holds no rank in
        (multiworld_operator.world_secrets). A retired connection gets nothing and is heard no
        more; it is closed when it ends, when its host is found lost, or RETIRED_PROBE_S later."""
        for key in [key for key in self._writers if key[0] == group]:
            uid = self._uids.get(key, "")
            if not current(key[1], uid):
                writer = self._writers.pop(key)
                self._sent.pop(key, None)
                self._uids.pop(key, None)
                if probe and not writer.is_closing():
                    self._retired[writer] = Speaker(group, key[1], uid)
                    self._ask_for_answer(writer)
                    asyncio.get_running_loop().call_later(RETIRED_PROBE_S, writer.close)
                else:
                    writer.close()

    def _ask_for_answer(self, writer: asyncio.StreamWriter) -> None:
        """Send a retired connection an empty line; ANSWER_WITHIN_S later, its host is lost if its
        kernel acknowledged nothing since."""
        try:
            writer.write(b"\n")
        except (ConnectionError, RuntimeError):
            return
        asyncio.get_running_loop().call_later(ANSWER_WITHIN_S, self._lost_unless_answered, writer)

    def _lost_unless_answered(self, writer: asyncio.StreamWriter) -> None:
        lost = self._retired.get(writer)
        if lost is None or writer.is_closing() or not _unacknowledged_for(writer, ANSWER_WITHIN_S):
            return  # ended (its process closed it), or answered
        del self._retired[writer]
        log.warning("pod %s (%s) acknowledged nothing for %.1f s: lost with its host", lost.pod, _peer(writer),
                    ANSWER_WITHIN_S)  # fmt: skip
        writer.transport.abort()
        if self._on_lost is not None:
            self._on_lost(lost)

    def _send(self, group: Hashable, pod: str, writer: asyncio.StreamWriter) -> None:
        table = self._tables.get(group)
        if table is None:
            return  # nothing published yet: sent with the first table
        part = table.for_pod(pod)
        sent = self._sent.get((group, pod))
        if sent is not None and sent.worlds == part.worlds:
            return
        try:
            writer.write(ChannelMessage(table=part).encode())
        except (ConnectionError, RuntimeError):
            self._writers.pop((group, pod), None)
            return
        unsent = writer.transport.get_write_buffer_size()
        if unsent > MAX_UNSENT:
            self._warn(
                ("unread", _host(writer)),
                "pod %s (%s) left %d bytes of tables unread; dropped its connection",
                pod,
                _peer(writer),
                unsent,
            )
            self._writers.pop((group, pod), None)
            writer.transport.abort()
            return
        self._sent[(group, pod)] = part

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        speaker: Speaker | None = None
        try:
            source = _host(writer)
            if not self._greeters.admit(writer, source):
                self._warn(
                    ("busy", source),
                    "%s has %d connections greeting already; closed %s",
                    source,
                    MAX_GREETING_PER_SOURCE,
                    _peer(writer),
                )
                return
            try:
                speaker = await asyncio.wait_for(self._greet(reader, writer), HELLO_TIMEOUT_S)
            except TimeoutError:
                self._warn(("silent", source), "%s sent no hello within %.0f s; closed", _peer(writer), HELLO_TIMEOUT_S)
            finally:
                self._greeters.leave(writer)
            if speaker is None:
                return
            key: Hashable = (speaker.group, speaker.pod)
            _probe_silence(writer)
            while line := await reader.readline():
                if writer in self._retired:  # its own budget: the pod's next instance keeps the pod's
                    key = (speaker.group, speaker.pod, speaker.uid)
                if not (self._messages.take(key) and self._bytes.take(key, len(line))):
                    await self._refuse(
                        writer,
                        f"pod {speaker.pod} sent more than {MESSAGE_BURST} messages or {BYTE_BURST // MIB} MiB at "
                        f"once, or than {MESSAGES_PER_S:g} messages or {BYTES_PER_S // KIB} KiB a second after",
                    )
                    return
                if writer not in self._retired:  # a retired instance is no longer heard
                    self._receive(speaker, line)
        except (ConnectionError, ValueError, asyncio.IncompleteReadError):
            pass  # gone, or a line over MAX_LINE: the worker reconnects
        except OSError as error:
            if error.errno != errno.ETIMEDOUT:
                raise
            # No acknowledgement for LOST_AFTER_S: the worker's host went silent.
            lost = self._retired.get(writer)
            if lost is None and speaker is not None and self._writers.get((speaker.group, speaker.pod)) is writer:
                lost = speaker
            if lost is not None:
                log.warning("pod %s (%s) stopped answering: lost with its host", lost.pod, _peer(writer))
                if self._on_lost is not None:
                    self._on_lost(lost)
        finally:
            if speaker is not None and self._writers.get((speaker.group, speaker.pod)) is writer:
                del self._writers[(speaker.group, speaker.pod)]
                self._uids.pop((speaker.group, speaker.pod), None)
            self._retired.pop(writer, None)
            writer.close()

    async def _greet(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Speaker | None:
        """The speaker of a new connection, which gets its part of the table; None (refused,
        and told why) unless the first line is a hello that proves who speaks."""
        try:
            line = await reader.readline()
            self._greeters.heard(writer)
            if writer.is_closing():
                return None  # closed as the oldest reading its hello
            hello = ChannelMessage.decode(line).hello
            if hello is None:
                raise Refused("the first message on a connection must be a hello")
            speaker = await self._authenticate(hello, _host(writer))
        except (Refused, ValidationError) as refusal:
            reason = str(refusal) if isinstance(refusal, Refused) else "the first line is not a channel message"
            await self._refuse(writer, reason)
            return None
        if writer.is_closing():
            return None
        key = (speaker.group, speaker.pod)
        previous = self._writers.get(key)
        if previous is not None and previous is not writer:
            previous.close()  # the pod's older connection (a process that restarted, say)
        self._writers[key] = writer
        self._uids[key] = speaker.uid
        self._sent.pop(key, None)  # a new process of that pod: it knows nothing yet
        self._send(speaker.group, speaker.pod, writer)
        return speaker

    async def _refuse(self, writer: asyncio.StreamWriter, reason: str) -> None:
        """Tell the worker why its connection closes (it retries more and more slowly)."""
        # Keyed by the source alone: a reason may quote what the connection claimed (a pod name),
        # which a source could vary at will.
        self._warn(("refused", _host(writer)), "refused a connection from %s: %s", _peer(writer), reason)
        writer.write(ChannelMessage(refused=reason).encode())
        try:
            await asyncio.wait_for(writer.drain(), REFUSE_WRITE_S)
        except TimeoutError:
            writer.transport.abort()  # it reads nothing: closed without being told

    def _receive(self, speaker: Speaker, line: bytes) -> None:
        try:
            message = ChannelMessage.decode(line)
        except ValidationError as exc:
            self._warn(("bad", speaker.group, speaker.pod), "bad message from pod %s: %s", speaker.pod, exc)
            return
        if message.report is not None:
            # Stamped with this clock: the platform compares it with its own sightings of pods.
            heard = datetime.now(UTC)
            self._on_report(speaker, message.report.model_copy(update={"pod": speaker.pod, "time": heard}))
        elif message.status is not None:
            self._on_status(speaker, message.status.model_copy(update={"pod": speaker.pod}))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in [*self._writers.values(), *self._retired]:
                writer.close()
            self._writers.clear()
            self._retired.clear()
            await self._server.wait_closed()


class _Greeters:
    """The connections that have not proven who speaks yet: at most MAX_GREETING_PER_SOURCE of a
    source, and at most MAX_READING still reading their hello (the oldest of those is closed to
    let a new one in). One that sent its hello line is never closed for another: its check (a
    TokenReview) is bounded by the hellos a source may say."""

    def __init__(self) -> None:
        self._sources: dict[asyncio.StreamWriter, str] = {}
        self._per_source: collections.Counter[str] = collections.Counter()
        # Those still reading their hello, oldest first.
        self._reading: dict[asyncio.StreamWriter, None] = {}

    def admit(self, writer: asyncio.StreamWriter, source: str) -> bool:
        """Count the connection in, closing the oldest still reading where they are too many;
        False (nothing counted) when its source has too many greeting."""
        if self._per_source[source] >= MAX_GREETING_PER_SOURCE:
            return False
        if len(self._reading) >= MAX_READING:
            oldest = next(iter(self._reading))
            del self._reading[oldest]
            oldest.transport.abort()
        self._sources[writer] = source
        self._per_source[source] += 1
        self._reading[writer] = None
        return True

    def heard(self, writer: asyncio.StreamWriter) -> None:
        """The connection's first line arrived."""
        self._reading.pop(writer, None)

    def leave(self, writer: asyncio.StreamWriter) -> None:
        """The connection proved who speaks, or is closed."""
        self._reading.pop(writer, None)
        source = self._sources.pop(writer)
        self._per_source[source] -= 1
        if not self._per_source[source]:
            del self._per_source[source]


def _tcp_socket(writer: asyncio.StreamWriter) -> Any:
    """The connection's TCP socket (IPv4 or IPv6), or None for any other (a test's Unix socket)."""
    sock = writer.get_extra_info("socket")
    return sock if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) else None


def _probe_silence(writer: asyncio.StreamWriter) -> None:
    """Have the kernel end the connection with ETIMEDOUT once its peer acknowledges nothing for
    LOST_AFTER_S (keepalive probes while it is quiet, the user timeout while data waits)."""
    sock = _tcp_socket(writer)
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    probes = max(1, (LOST_AFTER_S - KEEPALIVE_IDLE_S) // KEEPALIVE_INTERVAL_S)
    for option, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", probes),
        ("TCP_USER_TIMEOUT", LOST_AFTER_S * 1000),
    ):
        if hasattr(socket, option):  # Linux has them all; elsewhere a host's silence goes unseen
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _unacknowledged_for(writer: asyncio.StreamWriter, seconds: float) -> bool:
    """Whether the connection has data out that its peer has not acknowledged, and no
    acknowledgement of anything came for `seconds` (Linux's TCP_INFO: tcpi_unacked, a count of
    segments, at byte 24; tcpi_last_ack_recv, milliseconds, at byte 56)."""
    sock = _tcp_socket(writer)
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return False
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return False
    (unacked,) = struct.unpack_from("I", info, 24)
    (last_ack_ms,) = struct.unpack_from("I", info, 56)
    return bool(unacked > 0 and last_ack_ms >= seconds * 1000)


def _host(writer: asyncio.StreamWriter) -> str:
    """The address a connection comes from, less its port (a reconnection gets a new one)."""
    address = writer.get_extra_info("peername")
    return str(address[0]) if isinstance(address, tuple) else str(address)


def _peer(writer: asyncio.StreamWriter) -> str:
    address = writer.get_extra_info("peername")
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
