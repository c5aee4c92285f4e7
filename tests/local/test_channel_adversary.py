"""A worker that is not ours against the platform's end of the worker channel (issue 32's
adversary kit): a real ChannelServer on loopback, driven from raw sockets only (never the
worker's StreamChannel, which keeps to the protocol). Huge, bursty and non-reading workers are
tests/local/test_channel_bounds.py's and test_channel_flood.py's; here:

- a line that is not JSON, not UTF-8, or JSON that is not a channel message: refused as a
  connection's first line (told why), dropped after a hello; said in the log once;
- a message before the hello: refused; a second hello: dropped, the connection still speaks for
  the pod its first hello named;
- a hello and a status dribbled a byte at a time: served within the hello's deadline, cut at it;
- a report replayed (a worker resends its latest report per world on every connection), and one
  for an older epoch after a newer one, through what each platform makes of a report: the
  operator's WorkerInbox (fed as its reconciler feeds it) and the local runner's PodProcesses;
- a status whose times have no timezone, which the planner compares with aware ones;
- (hypothesis) lines built from contract.py's models, their fields within, at and just past their
  bounds, some of them broken in shape: each taken if the model takes it, refused or dropped if
  not.

Each also holds that no exception escaped a connection's task and that a well-behaved raw worker
is still served afterwards: it gets its part of the table, and its status is taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import re
import time
import types
import typing
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import AwareDatetime, BaseModel, ValidationError

from multiworld.contract import BrokenWorldReport, ChannelMessage, Hello, WorkerStatus, WorldEntry, WorldTable
from multiworld_operator import channel_server
from multiworld_operator.channel_server import ChannelServer, Speaker
from multiworld_operator.kube.workers.worker_inbox import MAX_REASON, WorkerInbox
from multiworld_operator.local.launcher import MemberLauncher
from multiworld_operator.local.pod_processes import PodProcesses
from multiworld_operator.local.view import LiveView
from multiworld_operator.spec.names import MAX_LABEL

# How long the server may take to answer on loopback, even on a loaded machine.
WITHIN_S = 10.0
# The hello's deadline in the test of a dribbled hello: long enough for a hello dribbled over a
# quarter of it on a loaded machine, short enough to wait out.
HELLO_TIMEOUT_S = 2.0
NOT_A_MESSAGE = "the first line is not a channel message"
NOT_A_HELLO = "the first message on a connection must be a hello"


def table(w_epoch: int, x_epoch: int, revision: int) -> WorldTable:
    """World w (alpha's) and world x (beta's), both with the well-behaved pod `good`."""
    return WorldTable(
        revision=revision,
        worlds=[
            WorldEntry(name="w", epoch=w_epoch, host="127.0.0.1", port=29500, pods=["good", "alpha"]),
            WorldEntry(name="x", epoch=x_epoch, host="127.0.0.1", port=29501, pods=["good", "beta"]),
        ],
    )


TABLE = table(w_epoch=3, x_epoch=1, revision=1)


def hello(pod: str) -> bytes:
    return ChannelMessage(hello=Hello(pod=pod)).encode()


def status(pod: str, step: int) -> WorkerStatus:
    """A status unlike those of other steps."""
    return WorkerStatus(pod=pod, joined={"w": step})


def report(world: str, epoch: int, reason: str = "peer timed out") -> bytes:
    return ChannelMessage(report=BrokenWorldReport(world=world, epoch=epoch, reason=reason, pod="alpha")).encode()


class Raw:
    """One connection of a worker that is not ours, written and read as bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Raw:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        with contextlib.suppress(ConnectionError):  # closed meanwhile: what it was told is still to be read
            await self.writer.drain()

    async def dribble(self, data: bytes, pause: float) -> None:
        """`data` a byte at a time, `pause` seconds apart, until all is sent or the server closed."""
        for byte in data:
            if self.reader.at_eof():
                return
            await self.send(bytes([byte]))
            await asyncio.sleep(pause)

    async def hello(self, pod: str) -> WorldTable:
        """Say hello as `pod`: the part of the table the server answers with."""
        await self.send(hello(pod))
        return await self.table()

    async def table(self) -> WorldTable:
        async with asyncio.timeout(WITHIN_S):
            message = ChannelMessage.decode(await self.reader.readline())
        assert message.table is not None, message
        return message.table

    async def closed(self, seconds: float = WITHIN_S) -> list[ChannelMessage]:
        """What the server said before it closed the connection, which it must do within `seconds`."""
        messages = []
        async with asyncio.timeout(seconds):
            with contextlib.suppress(ConnectionResetError):  # closed with what we sent unread
                while line := await self.reader.readline():
                    messages.append(ChannelMessage.decode(line))
        return messages

    def close(self) -> None:
        self.writer.close()


class Platform:
    """A real ChannelServer with a table published, each report going where each platform sends
    it: the operator's WorkerInbox (as its reconciler feeds it: the pod, the table last published)
    and the local runner's PodProcesses (as its runner does). It keeps what it took, and every
    exception that escaped a connection's task (the event loop's exception handler hears of it)."""

    def __init__(self) -> None:
        self.table = TABLE
        self.statuses: list[tuple[Speaker, WorkerStatus]] = []
        self.reports: list[tuple[Speaker, BrokenWorldReport]] = []
        self.inbox = WorkerInbox()
        launcher = MemberLauncher("adversary", {}, Path(), Path(), {})
        self.local = PodProcesses(launcher, LiveView("adversary", io.StringIO(), live=False), lambda: None)
        self.escaped: list[dict[str, Any]] = []
        self.server = ChannelServer(self._report, lambda speaker, said: self.statuses.append((speaker, said)))
        self.port = 0
        self._served = itertools.count()

    @classmethod
    async def start(cls) -> Platform:
        platform = cls()
        asyncio.get_running_loop().set_exception_handler(lambda _, context: platform.escaped.append(context))
        platform.port = await platform.server.start()
        platform.server.publish(platform.table)
        return platform

    def _report(self, speaker: Speaker, said: BrokenWorldReport) -> None:
        self.reports.append((speaker, said))
        self.inbox.report(speaker.pod, said, self.table)
        self.local.on_report(said)

    def publish(self, new: WorldTable) -> None:
        self.table = new
        self.server.publish(new)

    def statuses_of(self, pod: str) -> list[WorkerStatus]:
        return [said for speaker, said in self.statuses if speaker.pod == pod]

    def reports_of(self, pod: str) -> list[BrokenWorldReport]:
        return [said for speaker, said in self.reports if speaker.pod == pod]

    async def took(self, pod: str, said: WorkerStatus) -> None:
        """Wait until `said` is taken as `pod`'s status."""
        async with asyncio.timeout(WITHIN_S):
            while said not in self.statuses_of(pod):
                await asyncio.sleep(0.01)

    async def heard_reports(self, count: int) -> None:
        async with asyncio.timeout(WITHIN_S):
            while len(self.reports) < count:
                await asyncio.sleep(0.01)

    async def serves(self, pod: str) -> None:
        """A well-behaved raw worker of `pod` gets its part of the table, and its status is taken."""
        worker = await Raw.open(self.port)
        assert await worker.hello(pod) == self.table.for_pod(pod)
        mark = WorkerStatus(pod=pod, plays=f"served {next(self._served)}")
        await worker.send(ChannelMessage(status=mark).encode())
        await self.took(pod, mark)
        worker.close()

    async def close(self) -> None:
        await self.server.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if tasks:  # the connections' own, ending with them
            await asyncio.wait(tasks, timeout=WITHIN_S)
        assert self.escaped == [], self.escaped


def said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    """The channel's log lines that contain `text`."""
    return [r.getMessage() for r in caplog.records if r.name == channel_server.__name__ and text in r.getMessage()]


JUNK = {
    "not JSON": b"GET / HTTP/1.1\r\n",
    "not UTF-8": b'{"hello": {"pod": "\xff\xfe"}}\n',
    "binary": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\x80\xff\n",
    "an empty line": b"\n",
    "JSON, not an object": b"[1, 2, 3]\n",
    "no field": b"{}\n",
    "two fields": b'{"hello": {"pod": "p"}, "status": {"pod": "p"}}\n',
    "a field the model does not know": b'{"hello": {"pod": "p", "admin": true}}\n',
    "a hello of no pod": b'{"hello": {"pod": ""}}\n',
    "a report at epoch 0": b'{"report": {"world": "w", "epoch": 0, "reason": "r"}}\n',
}


@pytest.mark.parametrize("junk", list(JUNK.values()), ids=list(JUNK))
def test_a_line_that_is_no_channel_message_is_refused_first_and_dropped_after_a_hello(
    junk: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """As a connection's first line: refused, told why, said once for two such connections. After
    a hello: dropped, said once for two such lines, and the connection serves on."""

    async def scenario() -> None:
        platform = await Platform.start()
        for _ in range(2):
            raw = await Raw.open(platform.port)
            await raw.send(junk)
            assert [message.refused for message in await raw.closed()] == [NOT_A_MESSAGE]
            raw.close()
        alpha = await Raw.open(platform.port)
        assert await alpha.hello("alpha") == TABLE.for_pod("alpha")
        mark = status("alpha", 1)
        await alpha.send(junk + junk + ChannelMessage(status=mark).encode())
        await platform.took("alpha", mark)
        assert platform.statuses_of("alpha") == [mark]
        assert platform.reports == []
        await platform.serves("good")
        alpha.close()
        await platform.close()

    with caplog.at_level("WARNING", logger=channel_server.__name__):
        asyncio.run(scenario())
    (refusal,) = said(caplog, "refused a connection from 127.0.0.1")
    assert refusal.endswith(NOT_A_MESSAGE), refusal
    assert len(said(caplog, "bad message from pod alpha:")) == 1


def test_a_message_before_the_hello_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """A status, then a report, each as a connection's first line: refused and told why, said in
    the log once, and neither taken."""

    async def scenario() -> None:
        platform = await Platform.start()
        for first in (ChannelMessage(status=status("alpha", 1)).encode(), report("w", 3)):
            raw = await Raw.open(platform.port)
            await raw.send(first + hello("alpha"))
            assert [message.refused for message in await raw.closed()] == [NOT_A_HELLO]
            raw.close()
        assert platform.statuses == [] and platform.reports == []
        await platform.serves("alpha")
        await platform.close()

    with caplog.at_level("WARNING", logger=channel_server.__name__):
        asyncio.run(scenario())
    (refusal,) = said(caplog, "refused a connection from 127.0.0.1")
    assert refusal.endswith(NOT_A_HELLO), refusal


def test_a_second_hello_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """A connection speaks for the pod its first hello named, whatever it says later: a second
    hello naming another pod is dropped (a well-formed message: nothing is said in the log), what
    follows is still the first pod's, the connection gets the first pod's part of the tables only,
    and the other pod's own connection is served beside it."""

    async def scenario() -> None:
        platform = await Platform.start()
        alpha = await Raw.open(platform.port)
        assert await alpha.hello("alpha") == TABLE.for_pod("alpha")
        await alpha.send(hello("beta") + ChannelMessage(status=status("beta", 1)).encode())
        await platform.took("alpha", status("alpha", 1))
        assert platform.statuses_of("beta") == []
        # Beta's world moves: nothing for this connection; then alpha's: its part.
        platform.publish(table(w_epoch=3, x_epoch=2, revision=2))
        platform.publish(table(w_epoch=4, x_epoch=2, revision=3))
        assert await alpha.table() == platform.table.for_pod("alpha")
        await platform.serves("beta")
        await alpha.send(ChannelMessage(status=status("alpha", 2)).encode())
        await platform.took("alpha", status("alpha", 2))  # not closed as beta's older connection
        alpha.close()
        await platform.close()

    with caplog.at_level("WARNING", logger=channel_server.__name__):
        asyncio.run(scenario())
    assert said(caplog, "") == []


def test_a_dribbled_hello_is_served_within_its_deadline_and_cut_at_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A hello a byte at a time, all of it within HELLO_TIMEOUT_S: served, and a status dribbled
    after it is taken (after the hello no deadline holds a line: the kernel's probes find a dead
    host). A hello dribbled slower: the connection is closed at the deadline, unserved and told
    nothing, and said in the log once."""
    monkeypatch.setattr(channel_server, "HELLO_TIMEOUT_S", HELLO_TIMEOUT_S)

    async def scenario() -> None:
        platform = await Platform.start()
        slow = await Raw.open(platform.port)
        line = hello("alpha")
        await slow.dribble(line, HELLO_TIMEOUT_S / 4 / len(line))
        assert await slow.table() == TABLE.for_pod("alpha")
        mark = status("alpha", 1)
        await slow.dribble(ChannelMessage(status=mark).encode(), 0.005)
        await platform.took("alpha", mark)

        slower = await Raw.open(platform.port)
        opened = time.monotonic()
        dribbling = asyncio.create_task(slower.dribble(hello("beta"), HELLO_TIMEOUT_S / 8))
        assert await slower.closed(HELLO_TIMEOUT_S + WITHIN_S) == []
        assert time.monotonic() - opened >= HELLO_TIMEOUT_S * 0.9
        await dribbling
        assert platform.statuses_of("beta") == []
        await platform.serves("beta")
        for worker in (slow, slower):
            worker.close()
        await platform.close()

    with caplog.at_level("WARNING", logger=channel_server.__name__):
        asyncio.run(scenario())
    assert len(said(caplog, f"sent no hello within {HELLO_TIMEOUT_S:.0f} s; closed")) == 1


async def replay(platform: Platform) -> None:
    """Alpha's report of world w at its epoch, twice on one connection, then again on the next
    (a worker resends its latest report per world on every connection)."""
    line = report("w", 3)
    first = await Raw.open(platform.port)
    assert await first.hello("alpha") == TABLE.for_pod("alpha")
    await first.send(line + line)
    await platform.heard_reports(2)
    again = await Raw.open(platform.port)
    assert await again.hello("alpha") == TABLE.for_pod("alpha")
    await again.send(line)
    await platform.heard_reports(3)
    await platform.serves("good")
    for worker in (first, again):
        worker.close()


def test_a_replayed_report_counts_once_for_the_operator() -> None:
    """The channel hands on each copy (stamped when heard); the operator keeps one report per pod
    and world."""

    async def scenario() -> None:
        platform = await Platform.start()
        await replay(platform)
        _, counted = platform.inbox.current(platform.table, ())
        assert [(r.world, r.epoch, r.pod) for r in counted] == [("w", 3, "alpha")]
        assert platform.inbox.take_refusals() == []
        await platform.close()

    asyncio.run(scenario())


def test_a_replayed_report_counts_once_in_a_local_runs_errors() -> None:
    """The local runner counts the breaks its workers report per world and epoch, each an error
    raised to member code (the summary's `errors`): one break, however often its report is sent."""

    async def scenario() -> None:
        platform = await Platform.start()
        await replay(platform)
        assert platform.local.breaks_of("w") == {3: 1}
        await platform.close()

    asyncio.run(scenario())


def test_a_report_for_an_older_epoch_after_a_newer_one_is_dropped() -> None:
    """Reports out of order: one at the world's epoch, then one at the epoch before (a report that
    crossed the table in flight: dropped quietly); the table moves on, then come one at the epoch
    left behind, one at an epoch not reached (refused, said on the MultiWorld) and one at the new
    epoch. What counts is the report at the world's current epoch only."""

    async def scenario() -> None:
        platform = await Platform.start()
        alpha = await Raw.open(platform.port)
        assert await alpha.hello("alpha") == TABLE.for_pod("alpha")
        await alpha.send(report("w", 3, "now") + report("w", 2, "stale"))
        await platform.heard_reports(2)
        _, counted = platform.inbox.current(platform.table, ())
        assert [(r.epoch, r.reason) for r in counted] == [(3, "now")]
        assert platform.inbox.take_refusals() == []

        platform.publish(table(w_epoch=4, x_epoch=1, revision=2))
        assert await alpha.table() == platform.table.for_pod("alpha")
        await alpha.send(report("w", 3, "late") + report("w", 5, "ahead") + report("w", 4, "current"))
        await platform.heard_reports(5)
        _, counted = platform.inbox.current(platform.table, ())
        assert [(r.epoch, r.reason) for r in counted] == [(4, "current")]
        (refusal,) = platform.inbox.take_refusals()
        assert "pod alpha reported world w broken at epoch 5" in refusal, refusal
        await platform.serves("good")
        alpha.close()
        await platform.close()

    asyncio.run(scenario())


def test_a_status_is_taken_with_timezone_aware_times_only() -> None:
    """A worker's clock says when it joined each world (`joined_at`), and the planner takes the
    latest of a world's ranks' times (readiness._formed_at) beside the platform's aware clock. A
    time with no timezone made that comparison raise TypeError ("can't compare offset-naive and
    offset-aware datetimes") in every step of the MultiWorld's reconcile loop for as long as the
    pod's status stood: one rank stalled every world of its MultiWorld. The contract takes aware
    times only, so such a line is dropped as a bad message."""

    async def scenario() -> None:
        platform = await Platform.start()
        alpha = await Raw.open(platform.port)
        assert await alpha.hello("alpha") == TABLE.for_pod("alpha")
        naive = '{"status": {"pod": "alpha", "joined": {"w": 3}, "joined_at": {"w": "2030-01-01T00:00:00"}}}\n'
        mark = status("alpha", 4)
        await alpha.send(naive.encode() + ChannelMessage(status=mark).encode())
        await platform.took("alpha", mark)
        for taken in platform.statuses_of("alpha"):
            times = [taken.started, *taken.joined_at.values()]
            assert all(t.tzinfo is not None for t in times if t is not None), taken
        await platform.serves("good")
        alpha.close()
        await platform.close()

    asyncio.run(scenario())


# Lengths every string is tried at, besides its own bounds': at and one past what the operator
# keeps of a label (a pod, a world) and of a report's reason.
LENGTHS = (0, 1, MAX_LABEL, MAX_LABEL + 1, MAX_REASON, MAX_REASON + 1)
# A value of some other JSON type, for a field that wants its own.
OTHER_TYPES: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


def _bounds(metadata: Sequence[object]) -> dict[str, Any]:
    """A field's bounds as pydantic keeps them (annotated_types' Ge, Le, MinLen, MaxLen; a pattern)."""
    names = ("ge", "le", "min_length", "max_length", "pattern")
    return {name: getattr(each, name) for each in metadata for name in names if getattr(each, name, None) is not None}


def _integers(bounds: dict[str, Any]) -> st.SearchStrategy[int]:
    """Within the bounds, at them and one past them, and past what a 64-bit integer holds."""
    low, high = bounds.get("ge"), bounds.get("le")
    edges = {-1, 0, 1, 2**63, -(2**63) - 1}
    edges |= {low - 1, low} if low is not None else set()
    edges |= {high, high + 1} if high is not None else set()
    return st.one_of(st.integers(low, high), st.sampled_from(sorted(edges)))


def _strings(bounds: dict[str, Any]) -> st.SearchStrategy[str]:
    """Any text, or a pattern's; and strings at and one past each length bound (a pattern's
    repetitions too), of 'a' (a hex digit, so they test a hex pattern's lengths)."""
    pattern = bounds.get("pattern")
    limits = [bounds.get("min_length"), bounds.get("max_length")]
    limits += [int(n) for pair in re.findall(r"\{(\d+),(\d+)\}", pattern or "") for n in pair]
    lengths = {*LENGTHS, *(n + step for n in limits if n is not None for step in (-1, 0, 1))}
    own = st.from_regex(pattern, fullmatch=True) if pattern else st.text(max_size=16)
    return st.one_of(own, st.sampled_from(sorted(n for n in lengths if n >= 0)).map(lambda n: "a" * n))


def _times() -> st.SearchStrategy[Any]:
    """Times as a worker writes them (ISO 8601, in UTC), with no timezone, as Unix time, and text."""
    return st.one_of(
        st.datetimes(timezones=st.just(UTC)).map(datetime.isoformat),
        st.datetimes().map(datetime.isoformat),
        st.integers(),
        st.text(max_size=8),
    )


def values(annotation: Any, metadata: Sequence[object] = ()) -> st.SearchStrategy[Any]:
    """JSON values for a field of type `annotation` with pydantic's `metadata` (its bounds)."""
    bounds = _bounds(metadata)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is types.UnionType:
        return st.one_of(*(values(arg, metadata) for arg in args))
    if annotation is type(None):
        return st.none()
    if origin is typing.Literal:
        return st.one_of(st.sampled_from(args), st.text(max_size=8))
    if origin is dict:
        return st.dictionaries(values(args[0]), values(args[1]), max_size=3)
    if origin is list:
        least = bounds.get("min_length", 0)
        return st.lists(values(args[0]), min_size=max(0, least - 1), max_size=least + 2)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_json(annotation)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return _integers(bounds)
    if annotation is str:
        return _strings(bounds)
    if annotation in (datetime, AwareDatetime):
        return _times()
    raise TypeError(f"no strategy for a field of type {annotation!r}: add one")


def model_json(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """A model as JSON: its required fields, and any of the others."""
    fields = {name: values(info.annotation, info.metadata) for name, info in model.model_fields.items()}
    required = {name for name, info in model.model_fields.items() if info.is_required()}
    return st.fixed_dictionaries(
        {name: fields[name] for name in required},
        optional={name: strategy for name, strategy in fields.items() if name not in required},
    )


@st.composite
def lines(draw: st.DrawFn) -> bytes:
    """A line as a worker might send it: one field of ChannelMessage (or none, or two), built from
    its model, then its model's shape kept or broken once (a field left out, one the model does not
    know, a value of another type); as ASCII JSON or as UTF-8."""
    fields = ChannelMessage.model_fields
    names = draw(
        st.one_of(
            st.sampled_from(list(fields)).map(lambda name: [name]),
            st.lists(st.sampled_from(list(fields)), max_size=2, unique=True),
        )
    )
    message = {name: draw(values(fields[name].annotation)) for name in names}
    body = message[names[0]] if names else None
    if isinstance(body, dict) and body:
        key = draw(st.sampled_from(sorted(body)))
        change = draw(st.sampled_from(("keep", "leave out", "add", "retype")))
        if change == "leave out":
            del body[key]
        elif change == "add":
            body[f"{key}-unknown"] = draw(OTHER_TYPES)
        elif change == "retype":
            body[key] = draw(OTHER_TYPES)
    return json.dumps(message, ensure_ascii=draw(st.booleans())).encode() + b"\n"


async def try_line(platform: Platform, line: bytes, pod: str, caplog: pytest.LogCaptureFixture) -> bool:
    """Send `line` first on a connection, then after a hello as `pod` (a new pod each time: a
    budget of its own); check what the server made of it against the model. Whether it was
    refused as a first line."""
    try:
        message: ChannelMessage | None = ChannelMessage.decode(line)
    except ValidationError:
        message = None
    # First on a connection: a hello is served its pod's part of the table, anything else refused.
    first = await Raw.open(platform.port)
    await first.send(line)
    if message is not None and message.hello is not None:
        assert await first.table() == platform.table.for_pod(message.hello.pod)
    else:
        assert [m.refused for m in await first.closed()] == [NOT_A_MESSAGE if message is None else NOT_A_HELLO]
    first.close()
    # After a hello: a status or a report is taken as the pod's, anything else dropped (said once
    # when it is no channel message), and the connection serves on.
    after = await Raw.open(platform.port)
    assert await after.hello(pod) == platform.table.for_pod(pod)
    mark = WorkerStatus(pod=pod, plays=f"{pod} is done")
    await after.send(line + ChannelMessage(status=mark).encode())
    await platform.took(pod, mark)
    after.close()
    taken = (
        [message.status.model_copy(update={"pod": pod})] if message is not None and message.status is not None else []
    )
    assert platform.statuses_of(pod) == [*taken, mark]
    heard = platform.reports_of(pod)
    if message is not None and message.report is not None:
        assert heard == [message.report.model_copy(update={"pod": pod, "time": heard[0].time})]
    else:
        assert heard == []
    assert len(said(caplog, f"bad message from pod {pod}:")) == (message is None)
    assert platform.escaped == []
    return message is None or message.hello is None


def test_any_line_built_from_the_contract_is_taken_if_the_model_takes_it(caplog: pytest.LogCaptureFixture) -> None:
    """Hypothesis builds lines from contract.py's models (one server, on one event loop, serves all
    its examples): each is served, taken, refused or dropped as the model says, nothing escapes a
    connection's task, the refusals are said in the log once, and a well-behaved worker is served
    after them all."""
    loop = asyncio.new_event_loop()
    platform = loop.run_until_complete(Platform.start())
    pods = (f"adversary-{n}" for n in itertools.count())
    refused: list[bool] = []

    @settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(line=lines())
    def each(line: bytes) -> None:
        refused.append(loop.run_until_complete(try_line(platform, line, next(pods), caplog)))

    with caplog.at_level("WARNING", logger=channel_server.__name__):
        try:
            each()
            loop.run_until_complete(platform.serves("good"))
        finally:
            loop.run_until_complete(platform.close())
            loop.close()
    assert len(said(caplog, "refused a connection from 127.0.0.1")) == any(refused)
