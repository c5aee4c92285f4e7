"""One failure detector per WorldManager (in practice, per process): heartbeats per pair of
processes, not per world.

A process that freezes or dies does so in every world it is in, so a world's members need not
heartbeat through each world's store: rank 0 of every world (its store host) judges the other
members, and they judge it, through one small store that the host's detector serves (the beat
store), with these keys:

- `beat/<token>`: one counter per process (its detector's random token), bumped every tick;
- `verdict/<prefix>`: a world's verdict (empty while healthy), copied from the world's abort
  key, under the world's store prefix (`<world>/<epoch>/<secret>/`: see rendezvous.py);
  `news/<host's token>`: bumped whenever a verdict is written here.
Like the world's store, the beat store answers anything that reaches its port: every key names
a token or a secret that only the members of a world this process hosts were told (in the
world's store, under its secret), so no other process can name one.

Every tick the host's detector thread bumps its own counter and reads `news` and the counters of
the member processes of the worlds it hosts (one multi_get). A member process whose counter has
not moved for a world's `dead_after` is dead in every world of that host it is in, silence being
measured on the judge's own clock, so that a judge that was itself paused does not take its
pause for the peer's silence, and confirmed by a second read (silence.py). A member
process keeps one link (a thread with its own client) per host process: every tick it bumps its
own counter and reads the host's counter and `news`. When `news` moves, the verdicts are read.
A tick costs two requests on each side whatever the number of worlds two processes share, and a
world's requests per tick grow linearly with its ranks. Its own store is asked only for what
happens there: verdicts, and now and then the newest epoch.

A link stuck in a call to a frozen host is noticed by the detector thread, which does no remote
I/O (its calls go to this process's own servers), and the worlds of that host break; the stuck
time too is measured on the detector thread's own clock.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

from pydantic import BaseModel

from multiworld import metrics
from multiworld.detect.config import DetectConfig
from multiworld.detect.silence import CONFIRM_YIELD_S, JudgeClock, StillCounter
from multiworld.detect.verdicts import Verdict, abort_key, epoch_key
from multiworld.errors import StoreLost, short
from multiworld.log_context import WorldLog
from multiworld.shutdown import start_thread
from multiworld.store import server as store_server
from multiworld.store.rules import BEAT_STORE

log = logging.getLogger(__name__)

# Each world's store is asked for its newest epoch once per this many dead_afters: a backstop
# (a member that moves on to a newer epoch closes the older one with a verdict), so rarely.
EPOCH_CHECK_DEAD_AFTERS = 5.0


class HeartbeatStore(Protocol):
    """The store calls a heartbeat makes (torch's TCPStore has them)."""

    def add(self, key: str, value: int) -> int: ...
    def get(self, key: str) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...


# on_failure(reason, peer_rank, publish, report): publish is True when this member reached
# the verdict itself (the world asks the heartbeat to publish it to the others); report is
# False when nothing failed (a peer left on purpose, or the platform moved on to a newer epoch).
FailureCallback = Callable[[str, "int | None", bool, bool], None]


def beat_key(token: str) -> str:
    return f"beat/{token}"


def news_key(host_token: str) -> str:
    return f"news/{host_token}"


def verdict_key(prefix: str) -> str:
    """Where the beat store holds the verdict of the world whose store prefix is `prefix`."""
    return f"verdict/{prefix}"


class StoreLoad(BaseModel):
    """Requests sent to stores: calls, and the keys they read or wrote."""

    calls: int = 0
    keys: int = 0


class HeartbeatLoad(BaseModel):
    """What a process's failure detection asked of stores since it started, and how near its
    judges came to a verdict."""

    host_ticks: int = 0
    link_ticks: int = 0
    beat_stores: StoreLoad = StoreLoad()
    world_stores: StoreLoad = StoreLoad()
    # The longest a judge of this process saw a peer's counter (or a call to a host) stand
    # still, in seconds of its own clock (silence.py), verdicts included: where no peer failed,
    # the margin left below dead_after.
    longest_silence: float = 0.0
    # Judge readings that came more than LATE_TICKS intervals after the previous one (the judge
    # itself ran late; its gap was cut), and confirmation reads that found a counter moving
    # after all (a verdict called off).
    late_readings: int = 0
    called_off: int = 0


class _Counted:
    """A store client that counts its requests into a StoreLoad. `token`: of a beat store, its
    host process's token (its keys name it). A beat store's client, used by one thread, holds
    its counts until that thread's tick is counted (`commit`), so that a reading of the load
    holds whole ticks only."""

    def __init__(
        self, store: HeartbeatStore, load: StoreLoad, lock: threading.Lock, token: str = "", *, per_tick: bool = False
    ) -> None:
        self._store = store
        self._load = load
        self._lock = lock
        self.token = token
        self._held = StoreLoad() if per_tick else None

    def _count(self, keys: int) -> None:
        if self._held is not None:
            self._held.calls += 1
            self._held.keys += keys
            return
        with self._lock:
            self._load.calls += 1
            self._load.keys += keys

    def commit(self) -> None:
        """Under the load's lock: the counts held since the last tick go into the load."""
        if self._held is not None:
            self._load.calls += self._held.calls
            self._load.keys += self._held.keys
            self._held = StoreLoad()

    def add(self, key: str, value: int) -> int:
        self._count(1)
        return self._store.add(key, value)

    def get(self, key: str) -> bytes:
        self._count(1)
        return self._store.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count(len(keys))
        return self._store.multi_get(keys)

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        self._count(1)
        return self._store.compare_set(key, expected_value, desired_value)


class Watch:
    """One world's place in its process's detector: what World calls."""

    def __init__(
        self,
        *,
        world: str,
        epoch: int,
        rank: int,
        prefix: str,
        config: DetectConfig,
        world_store: HeartbeatStore | None,
        on_failure: FailureCallback,
        reads_epoch: bool = True,
    ) -> None:
        """`reads_epoch`: whether the world's store says which epoch is current (a world
        without a secret: see rendezvous.py)."""
        self.world = world
        self.epoch = epoch
        self.log = WorldLog(log, world, epoch)
        self.rank = rank
        self.prefix = prefix
        self.interval = config.heartbeat_interval
        self.dead_after = config.dead_after
        self.world_store = world_store
        self.reads_epoch = reads_epoch
        self._on_failure = on_failure
        # On the host's side: the other members' processes' tokens -> their ranks.
        self.ranks: dict[str, int] = {}
        self._outbox: Verdict | None = None
        self._failed = False
        self._fail_lock = threading.Lock()
        self._done = threading.Event()
        self._owner: _Owner | None = None

    @property
    def verdict_key(self) -> str:
        return verdict_key(self.prefix)

    def publish(self, verdict: Verdict) -> None:
        """Write this member's verdict to the world's abort key and to its host's beat store
        (on the detector's threads), then stop."""
        self._outbox = verdict
        self.stop()

    def stop(self) -> None:
        owner = self._owner
        if owner is None:
            self.finish()  # nothing runs for this world: no heartbeat, or its link is gone
        else:
            owner.end(self)

    def join(self, timeout: float | None) -> None:
        """Wait (bounded) until the verdict is written or the watch has stopped."""
        owner = self._owner
        if owner is None or not owner.runs_on_this_thread():
            self._done.wait(timeout)

    def finish(self) -> None:
        self._owner = None
        self._done.set()

    def fail(self, reason: str, peer_rank: int | None, *, publish: bool = False, report: bool = True) -> None:
        with self._fail_lock:
            if self._failed:
                return
            self._failed = True
        try:
            self._on_failure(reason, peer_rank, publish, report)
        except Exception:
            self.log.exception("failure callback raised")

    def settle(self, beats: _Counted) -> None:
        """The world ended here: write its verdict (if any) where the others read it."""
        verdict = self._outbox
        if verdict is not None and self.world_store is not None:
            try:
                # The world's abort key decides which verdict wins; the beat store carries it.
                winner = self.world_store.compare_set(abort_key(self.prefix), "", verdict.encode())
                beats.compare_set(self.verdict_key, "", winner.decode())
                beats.add(news_key(beats.token), 1)
            except Exception as exc:
                self.log.debug("could not publish verdict: %s", short(exc))
        self.finish()

    def apply_verdict(self, raw: bytes) -> None:
        if raw:
            verdict = Verdict.decode(raw)
            self.fail(verdict.describe(), verdict.peer_rank, report=not verdict.deliberate)

    def judge(self, rank: int, silent: float) -> None:
        """A reading found the counter of `rank`'s process still for `silent` seconds: a miss
        past two of this world's intervals (a single late tick is none), a death past dead_after."""
        if self._failed:
            return
        if silent > 2 * self.interval:
            metrics.heartbeat_missed(self.world)
        if silent > self.dead_after:
            self.fail(f"rank {rank} sent no heartbeat for {silent:.1f}s", rank, publish=True)

    def check_epoch(self) -> None:
        """Has the world's store moved on to a newer epoch?"""
        if self._failed or self.world_store is None or not self.reads_epoch:
            return
        try:
            current = int(self.world_store.get(epoch_key(self.world)) or 0)
        except Exception as exc:  # this world's store only: its host may serve the others still
            self.fail(f"the world's store is unreachable: {short(exc)}", 0)
            return
        if current > self.epoch:
            self.fail(f"superseded by epoch {current}", None, report=False)


_DEFAULT_INTERVAL: float = DetectConfig.model_fields["heartbeat_interval"].default


class _Owner:
    """A thread that serves watches (the detector's own, or a link's): their ticks, and the
    verdicts of those that end."""

    def __init__(self) -> None:
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # The owner thread's own clock, by which it measures silences (silence.py).
        self._clock = JudgeClock(_DEFAULT_INTERVAL)
        self._tick_began = 0.0  # monotonic
        self._ending: list[Watch] = []
        self._ending_lock = threading.Lock()
        self._epoch_turn = 0
        self._epoch_credit = 0.0

    def wake(self) -> None:
        self._wake.set()

    def end(self, watch: Watch) -> None:
        with self._ending_lock:
            self._ending.append(watch)
        self._wake.set()

    def runs_on_this_thread(self) -> bool:
        return self._thread is threading.current_thread()

    def _take_ending(self) -> list[Watch]:
        with self._ending_lock:
            ending, self._ending = self._ending, []
        return ending

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _next_tick(self, tick: float) -> None:
        """Sleep until the next tick is due: `tick` after the previous one began, not after its
        work ended, so that work slowed down (waiting for the GIL or a core, a slow store)
        delays the next beat the less."""
        self._sleep(max(self._tick_began + tick - time.monotonic(), 0.0))
        self._tick_began = time.monotonic()

    def _check_epochs(self, watches: Sequence[Watch], call: Callable[[Callable[[], None]], None]) -> None:
        """A few watches per tick, so that each world's epoch is read once per
        EPOCH_CHECK_DEAD_AFTERS x dead_after."""
        if not watches:
            return
        first = watches[0]
        ticks = max(1.0, EPOCH_CHECK_DEAD_AFTERS * first.dead_after / first.interval)
        self._epoch_credit = min(self._epoch_credit + len(watches) / ticks, float(len(watches)))
        while self._epoch_credit >= 1.0:
            self._epoch_credit -= 1.0
            self._epoch_turn = (self._epoch_turn + 1) % len(watches)
            call(watches[self._epoch_turn].check_epoch)


def _interval(watches: Sequence[Watch]) -> float:
    return min((w.interval for w in watches), default=_DEFAULT_INTERVAL)


def _now_call(fn: Callable[[], None]) -> None:
    fn()


class _Link(_Owner):
    """A member process's link to one host process's beat store, for every world of that host
    the member is in. Its thread owns its client; a call stuck on a frozen host is noticed by
    the detector thread."""

    def __init__(self, detector: Detector, key: tuple[str, int, str], beats: _Counted) -> None:
        super().__init__()
        self._detector = detector
        self.key = key
        self._beats: _Counted | None = beats
        self.watches: list[Watch] = []
        self._new: list[Watch] = []
        # Joins that connected through this link and will watch their world here (or unpin).
        self.pins = 0
        self.abandoned = False
        # The call in flight (None between calls): its number and its monotonic start.
        self._in_call: tuple[int, float] | None = None
        self._calls = 0
        # On the detector's thread: the call it found in flight, and its start on that
        # thread's clock.
        self._stuck: tuple[int, float] | None = None

    def add(self, watch: Watch) -> None:
        """Under the detector's lock."""
        watch._owner = self
        self._new.append(watch)
        self.pins -= 1
        if self._thread is None:
            host, port, _ = self.key
            self._thread = start_thread(self._run, f"mw-beat-{host}:{port}")
        else:
            self.wake()

    def check_stall(self, clock: JudgeClock, now: float) -> float:
        """On the detector's thread, whose clock read `now`: how long the call in flight has
        been stuck by that clock; past dead_after, confirmed after a yield to this link's
        thread, every world of the host breaks here."""
        in_call, watches = self._in_call, self.watches
        if in_call is None or not watches:
            self._stuck = None
            return 0.0
        if self._stuck is None or self._stuck[0] != in_call[0]:
            self._stuck = (in_call[0], clock.since_wall(in_call[1]))
        stuck = now - self._stuck[1]
        if stuck > min(w.dead_after for w in watches):
            time.sleep(CONFIRM_YIELD_S)  # this link's thread may have its answer already
            if self._in_call == in_call:
                self._end(f"the world's store host did not answer for {stuck:.1f}s")
        return stuck

    def _end(self, reason: str) -> None:
        """The host is gone for this process: every world of it breaks here."""
        for watch in self._detector._drop_link(self):
            watch.fail(reason, 0)
            watch.finish()

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._calls += 1
        self._in_call = (self._calls, time.monotonic())
        try:
            return fn(*args)
        finally:
            self._in_call = None

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:
            if not self.abandoned:
                self._end(f"the world's store is unreachable: {short(exc)}")
        finally:
            self._beats = None  # the client is dropped on this thread, never on a caller's

    def _loop(self) -> None:
        beats = self._beats
        assert beats is not None
        mine, theirs = beat_key(self._detector.token), beat_key(self.key[2])
        clock = self._clock
        host = StillCounter(clock.now())
        news: bytes | None = None
        while not self.abandoned:
            # New watches join the others first, so that a stall in making their keys counts.
            new = self._detector._take_new(self)
            watches = self._detector._keep_link(self, new)
            if watches is None:
                return
            for watch in new:  # a verdict written before the watch began is read here
                watch.apply_verdict(self._call(beats.compare_set, watch.verdict_key, "", ""))
            for watch in self._take_ending():
                self._call(watch.settle, beats)
            watches = [w for w in watches if w._owner is self]
            tick = clock.interval = _interval(watches)
            self._next_tick(tick)
            if not watches:
                continue  # a join is about to watch its world here
            self._call(beats.add, mine, 1)
            sent = clock.now()
            host_beat, now_news = self._call(beats.multi_get, [theirs, news_key(self.key[2])])
            silent = host.see(host_beat, sent, clock.now())
            called_off = 0
            if silent > min(w.dead_after for w in watches):  # a confirmation read first
                sent = clock.now()
                silent = host.see(self._call(beats.get, theirs), sent, clock.now())
                called_off = int(silent == 0.0)
            self._detector._count_tick(beats, link=True, silence=silent, late=clock.take_late(), called_off=called_off)
            if silent > 2 * tick:  # a beat missed, or more: each world judges by its own settings
                for watch in watches:
                    watch.judge(0, silent)
            if now_news != news:
                news = now_news
                for watch, raw in zip(
                    watches, self._call(beats.multi_get, [w.verdict_key for w in watches]), strict=True
                ):
                    watch.apply_verdict(raw)
            self._check_epochs(watches, self._call)


class Detector(_Owner):
    """The failure detector of one WorldManager: its beat store (served once it hosts a world),
    its thread, and its links to the hosts of the worlds it is a member of."""

    def __init__(self) -> None:
        super().__init__()
        # Unguessable: the beat store's keys name it (see the module's docstring).
        self.token = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._load = HeartbeatLoad()
        self._load_lock = threading.Lock()
        self._server: store_server.StoreServer | None = None
        self._beats: _Counted | None = None
        self._hosted: list[Watch] = []
        self._fresh: list[Watch] = []  # hosted watches whose keys are not made yet
        self._links: dict[tuple[str, int, str], _Link] = {}
        self._counters: dict[str, StillCounter] = {}
        # The member processes of the hosted worlds: their tokens, and the worlds of each.
        self._members: dict[str, list[Watch]] = {}
        self._news: bytes | None = None
        self._tick = _interval([])
        self._closed = False

    # -- what a join calls -----------------------------------------------------------------

    def announce(self, host: str | None) -> dict[str, object]:
        """What this process tells the other members at a rendezvous: its token, and where its
        beat store listens when it hosts the world (served from now on), which its members
        reach at `host` (None: it does not host the world)."""
        if host is None:
            return {"beat": self.token}
        with self._lock:
            self._closed = False
            server = self._server or self._serve(host)
            return {"beat": self.token, "beat_port": server.port}

    def connect_link(self, host: str, rank0: Mapping[str, object], timeout: float) -> None:
        """Before the communicator is built (a barrier of all members): connect this process's
        link to the host's beat store unless it has one, so that the host, which judges this
        process once its communicator is built, never waits for the connection. The link is
        kept for `watch` (or `unpin`, when the join fails)."""
        key = _link_key(host, rank0)
        if key is None:
            return
        with self._lock:
            link = self._links.get(key)
            if link is not None:
                link.pins += 1
                return
        from torch.distributed import TCPStore

        try:
            store = TCPStore(key[0], key[1], None, False, timedelta(seconds=timeout))
        except Exception as exc:
            raise StoreLost(f"cannot reach the failure detector of rank 0 at {key[0]}:{key[1]}: {short(exc)}") from exc
        with self._lock:
            beats = self._counted(store, self._load.beat_stores, key[2], per_tick=True)
            link = self._links.setdefault(key, _Link(self, key, beats))
            link.pins += 1

    def unpin(self, host: str, rank0: Mapping[str, object]) -> None:
        """A join that called `connect_link` failed before it could watch its world."""
        key = _link_key(host, rank0)
        with self._lock:
            link = self._links.get(key) if key is not None else None
            if link is None:
                return
            link.pins -= 1
            if link._thread is None and not link.pins and not link._new:
                del self._links[link.key]  # never started: nothing else holds it
        link.wake()

    def watch(self, watch: Watch, members: Sequence[Mapping[str, object]], host: str) -> None:
        """Start judging a joined world: `members` is what each rank announced at the
        rendezvous, `host` where rank 0 serves the world's store."""
        if watch.world_store is not None:
            watch.world_store = self._counted(watch.world_store, self._load.world_stores)
        if not self._attach(watch, members, host):
            watch.fail("the world's store host did not answer before the world was watched", 0)
        self.wake()

    def _attach(self, watch: Watch, members: Sequence[Mapping[str, object]], host: str) -> bool:
        """False when the link to the world's host failed before its world could be watched."""
        with self._lock:
            if watch.rank == 0:
                watch.ranks = {str(m["beat"]): rank for rank, m in enumerate(members) if rank and m.get("beat")}
                watch._owner = self
                self._fresh.append(watch)
            else:
                key = _link_key(host, members[0])
                if key is None:
                    return True  # rank 0 runs no heartbeat
                link = self._links.get(key)
                if link is None:
                    return False
                link.add(watch)
            if self._thread is None:
                self._thread = start_thread(self._run, "mw-detector")
        return True

    def load(self) -> HeartbeatLoad:
        with self._load_lock:
            return self._load.model_copy(deep=True)

    def close(self) -> None:
        """Stop serving the beat store once the hosted worlds' verdicts are written (the
        manager closed those worlds) and the members had a couple of ticks to read them."""
        with self._lock:
            self._closed = True
            idle = self._thread is None
        if idle:
            self._stop_serving()
        else:
            self.wake()

    # -- for the links -------------------------------------------------------------------

    def _counted(self, store: HeartbeatStore, load: StoreLoad, token: str = "", *, per_tick: bool = False) -> _Counted:
        return _Counted(store, load, self._load_lock, token, per_tick=per_tick)

    def _count_tick(
        self, beats: _Counted, *, link: bool, silence: float = 0.0, late: int = 0, called_off: int = 0
    ) -> None:
        with self._load_lock:
            beats.commit()
            load = self._load
            if link:
                load.link_ticks += 1
            else:
                load.host_ticks += 1
            load.longest_silence = max(load.longest_silence, silence)
            load.late_readings += late
            load.called_off += called_off

    def _take_new(self, link: _Link) -> list[Watch]:
        with self._lock:
            new, link._new = link._new, []
        return new

    def _keep_link(self, link: _Link, new: list[Watch]) -> list[Watch] | None:
        """Update the link's live watches; None once it has none left (it is dropped then)."""
        with self._lock:
            link.watches = [w for w in link.watches + new if w._owner is link]
            if link.watches or link._new or link.pins > 0:
                return list(link.watches)
            if self._links.get(link.key) is link:
                del self._links[link.key]
            return None

    def _drop_link(self, link: _Link) -> list[Watch]:
        """Forget a link whose host is gone; its watches."""
        with self._lock:
            link.abandoned = True
            if self._links.get(link.key) is link:
                del self._links[link.key]
            watches = [w for w in link.watches + link._new if w._owner is link]
            link.watches, link._new = [], []
        return watches

    # -- the detector's own thread -------------------------------------------------------------

    def _serve(self, host: str) -> store_server.StoreServer:
        server = store_server.serve(host, 0, BEAT_STORE)
        beats = self._counted(server.client(), self._load.beat_stores, self.token, per_tick=True)
        beats.add(beat_key(self.token), 0)
        beats.add(news_key(self.token), 0)
        self._server, self._beats = server, beats
        return server

    def _stop_serving(self) -> None:
        with self._lock:
            server = self._server
            if server is None or self._hosted or self._fresh or not self._closed:
                return
            self._server = self._beats = None
        server.close()

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except Exception:
            log.exception("the failure detector crashed")
            with self._lock:
                self._thread = None

    def _step(self) -> bool:
        """One tick of the detector thread; False once it has nothing left to watch."""
        with self._lock:
            fresh, self._fresh = self._fresh, []
            links = [link for link in self._links.values() if link._thread is not None]
            idle = not fresh and not self._hosted and not links and not self._ending
            if idle:
                self._thread = None
                closing = self._closed
        if idle:
            if closing:
                time.sleep(2 * self._tick)  # the members read the last verdicts meanwhile
                self._stop_serving()
            return False
        self._host(fresh)
        self._tick = self._clock.interval = _interval(self._hosted + [w for link in links for w in link.watches])
        self._next_tick(self._tick)
        now = self._clock.now()
        stuck = max((link.check_stall(self._clock, now) for link in links), default=0.0)
        with self._load_lock:
            self._load.longest_silence = max(self._load.longest_silence, stuck)
            self._load.late_readings += self._clock.take_late()
        return True

    def _host(self, fresh: list[Watch]) -> None:
        """The host's duties, all on this process's own servers: settle verdicts, judge the
        member processes, read what changed."""
        beats = self._beats
        if beats is None:  # the manager closed, and a join finished after it: nothing to tell
            for watch in fresh + self._take_ending():
                watch.finish()
            return
        for watch in fresh:  # a verdict written before the watch began is read here
            watch.apply_verdict(beats.compare_set(watch.verdict_key, "", ""))
            for token in watch.ranks:
                beats.add(beat_key(token), 0)
                if token not in self._members:
                    self._counters[token] = StillCounter(self._clock.now())  # new to this host
        ending = self._take_ending()
        for watch in ending:
            watch.settle(beats)
        if fresh or ending:
            with self._lock:
                self._hosted = [w for w in self._hosted + fresh if w._owner is self]
            self._members = {}
            for watch in self._hosted:
                for token in watch.ranks:
                    self._members.setdefault(token, []).append(watch)
            self._counters = {t: c for t, c in self._counters.items() if t in self._members}
        if not self._hosted:
            return
        tokens, clock = list(self._members), self._clock
        beats.add(beat_key(self.token), 1)
        sent = clock.now()
        values = beats.multi_get([news_key(self.token)] + [beat_key(t) for t in tokens])
        returned = clock.now()
        silences = {
            token: self._counters.setdefault(token, StillCounter(sent)).see(value, sent, returned)
            for token, value in zip(tokens, values[1:], strict=True)
        }
        # A confirmation read before any verdict (silence.py).
        suspects = [t for t, s in silences.items() if s > min(w.dead_after for w in self._members[t])]
        if suspects:
            sent = clock.now()
            again = beats.multi_get([beat_key(t) for t in suspects])
            returned = clock.now()
            for token, value in zip(suspects, again, strict=True):
                silences[token] = self._counters[token].see(value, sent, returned)
        called_off = sum(silences[t] == 0.0 for t in suspects)
        longest = max(silences.values(), default=0.0)
        self._count_tick(beats, link=False, silence=longest, called_off=called_off)
        for token, silent in silences.items():
            worlds = self._members[token]
            if silent > 2 * min(w.interval for w in worlds):  # as in _Link._loop
                for watch in worlds:
                    watch.judge(watch.ranks[token], silent)
        if values[0] != self._news:
            self._news = values[0]
            hosted = list(self._hosted)
            for watch, raw in zip(hosted, beats.multi_get([w.verdict_key for w in hosted]), strict=True):
                watch.apply_verdict(raw)
        self._check_epochs(self._hosted, _now_call)


def _link_key(host: str, rank0: Mapping[str, object]) -> tuple[str, int, str] | None:
    """Where rank 0's beat store is (None when it runs no heartbeat)."""
    token, port = rank0.get("beat"), rank0.get("beat_port")
    if not token or not port:
        return None
    return host, int(str(port)), str(token)
