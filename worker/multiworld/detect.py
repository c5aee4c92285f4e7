"""Failure detection, in layers (no torch here; the store clients come from the caller).

1. Op errors: a failed op breaks its world at once (see world.py).
2. A heartbeat per world, on its own store client and its own thread: every tick it bumps its
   own counter and reads the peers' counters, the world's abort key and the world's current
   epoch. A peer whose counter stops moving for `dead_after` is dead.
3. The abort key: the first member to reach a verdict writes it; the others read it on their
   next tick, so one verdict reaches every member within a tick.
4. A stall watch: a store call to a frozen store host never returns (TCPStore clients have no
   timeout for that), so one process-wide thread without I/O notices a heartbeat stuck in a
   call for `dead_after` and breaks that world.
5. The communicator's own op timeout (`op_timeout`) as the last backstop.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from multiworld.shutdown import start_thread

log = logging.getLogger(__name__)

ENV_HEARTBEAT_INTERVAL = "MULTIWORLD_HEARTBEAT_INTERVAL"
ENV_DEAD_AFTER = "MULTIWORLD_DEAD_AFTER"
ENV_OP_TIMEOUT = "MULTIWORLD_OP_TIMEOUT"
ENV_JOIN_TIMEOUT = "MULTIWORLD_JOIN_TIMEOUT"

_ENV_FIELDS = {
    ENV_HEARTBEAT_INTERVAL: "heartbeat_interval",
    ENV_DEAD_AFTER: "dead_after",
    ENV_OP_TIMEOUT: "op_timeout",
    ENV_JOIN_TIMEOUT: "join_timeout",
}


class DetectConfig(BaseModel):
    """Detection and timeout settings, in seconds. Defaults: a crashed peer of a busy world is
    seen through the op error (tens of ms); an idle, crashed or frozen peer within
    `heartbeat_interval + dead_after` (about 1.1 s)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Time between heartbeat ticks; also how long a caller blocked in a broken world's op
    # stays blocked after the verdict, so that live peers read the verdict first.
    heartbeat_interval: float = Field(default=0.1, gt=0)
    # A peer whose heartbeat has not moved for this long is dead; a store call stuck this long
    # means the store host is gone.
    dead_after: float = Field(default=1.0, gt=0)
    # The communicator's own per-op timeout: a backstop for what the heartbeat cannot see.
    op_timeout: float = Field(default=120.0, gt=0)
    # How long a rendezvous waits for all members.
    join_timeout: float = Field(default=300.0, gt=0)
    # False: worlds joined with this config run no heartbeat (nor stall watch); an idle peer's
    # death is then seen only through op errors and `op_timeout`.
    heartbeat: bool = True

    @model_validator(mode="after")
    def _dead_after_spans_ticks(self) -> DetectConfig:
        if self.dead_after <= 2 * self.heartbeat_interval:
            raise ValueError(
                f"dead_after ({self.dead_after}s) must be more than twice heartbeat_interval "
                f"({self.heartbeat_interval}s), or a single late tick would kill a healthy peer"
            )
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DetectConfig:
        """Defaults, overridden by MULTIWORLD_HEARTBEAT_INTERVAL, MULTIWORLD_DEAD_AFTER,
        MULTIWORLD_OP_TIMEOUT and MULTIWORLD_JOIN_TIMEOUT where set."""
        environ = os.environ if environ is None else environ
        values: dict[str, float] = {}
        for env_name, field in _ENV_FIELDS.items():
            raw = environ.get(env_name, "").strip()
            if not raw:
                continue
            try:
                values[field] = float(raw)
            except ValueError:
                raise ValueError(f"{env_name}={raw!r} is not a number of seconds") from None
        try:
            return cls(**values)
        except ValidationError as exc:
            names = {field: env for env, field in _ENV_FIELDS.items()}
            fields = [names.get(str(err["loc"][0]), "") for err in exc.errors() if err["loc"]]
            hint = f" (from {', '.join(f for f in fields if f)})" if any(fields) else ""
            raise ValueError(f"invalid detection settings{hint}: {exc}") from None


class Verdict(BaseModel):
    """What a member writes to a world's abort key: why the world is broken."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    reason: str
    peer_rank: int | None = None
    by_rank: int
    # True when a member drops the world on purpose (leaves, closes, moves on): the others
    # break it too, but nothing failed, so nobody reports it.
    deliberate: bool = False

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, raw: bytes) -> Verdict:
        try:
            return cls.model_validate_json(raw)
        except ValidationError:
            return cls(reason=raw.decode(errors="replace"), by_rank=-1)

    def describe(self) -> str:
        return self.reason if self.by_rank < 0 else f"{self.reason} (verdict of rank {self.by_rank})"


class HeartbeatStore(Protocol):
    """The store calls a heartbeat makes (torch's TCPStore has them)."""

    def add(self, key: str, value: int) -> int: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...


# on_failure(reason, peer_rank, publish, report): publish is True when this member reached
# the verdict itself (the world asks the heartbeat to publish it to the others); report is
# False when nothing failed (a peer left on purpose, or the platform moved on to a newer epoch).
FailureCallback = Callable[[str, "int | None", bool, bool], None]


def abort_key(prefix: str) -> str:
    return f"{prefix}abort"


def heartbeat_key(prefix: str, rank: int) -> str:
    return f"{prefix}hb/{rank}"


def epoch_key(world: str) -> str:
    """Outside the epoch prefix on purpose: it says which epoch is current."""
    return f"{world}/epoch"


# "[/path/to/gloo/transport/tcp/pair.cc:553] " at the start of gloo's errors.
_SOURCE_LOCATION = re.compile(r"^\[[^\]]+:\d+\]\s*")


def short(exc: BaseException) -> str:
    """The first line of an error, without gloo's source location and long hints."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = _SOURCE_LOCATION.sub("", text).split(" This is typically caused")[0]
    return text[:300]


class Heartbeat:
    """One world's liveness loop, on its own store client and its own daemon thread."""

    def __init__(
        self,
        *,
        world: str,
        epoch: int,
        rank: int,
        size: int,
        prefix: str,
        store: HeartbeatStore,
        config: DetectConfig,
        on_failure: FailureCallback,
    ) -> None:
        self.world = world
        self._epoch = epoch
        self._rank = rank
        self._size = size
        self._store: HeartbeatStore | None = store
        self._enabled = config.heartbeat
        self._interval = config.heartbeat_interval
        self.dead_after = config.dead_after
        self._on_failure = on_failure
        self._own_key = heartbeat_key(prefix, rank)
        self._abort_key = abort_key(prefix)
        self._keys = [heartbeat_key(prefix, r) for r in range(size)] + [self._abort_key, epoch_key(world)]
        self._wake = threading.Event()
        self._stopping = False
        self._outbox: Verdict | None = None
        self._failed = False
        self._fail_lock = threading.Lock()
        # Monotonic start of the store call in flight (None between calls), for the stall watch.
        self._call_started: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self._enabled:
            self._store = None
            return
        STALL_WATCH.add(self)
        self._thread = start_thread(self._run, f"mw-heartbeat-{self.world}-{self._epoch}")

    def publish(self, verdict: Verdict) -> None:
        """Write this member's verdict to the abort key (on the heartbeat thread), then stop."""
        self._outbox = verdict
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def join(self, timeout: float | None) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout)

    def check_stall(self, now: float) -> None:
        started = self._call_started
        if started is not None and now - started > self.dead_after:
            self._fail(f"the world's store host did not answer for {now - started:.1f}s", 0)

    def _fail(self, reason: str, peer_rank: int | None, *, publish: bool = False, report: bool = True) -> None:
        with self._fail_lock:
            if self._failed:
                return
            self._failed = True
        try:
            self._on_failure(reason, peer_rank, publish, report)
        except Exception:
            log.exception("world %s: failure callback raised", self.world)

    def _call(self, fn: Callable[[HeartbeatStore], object]) -> object:
        store = self._store
        assert store is not None
        self._call_started = time.monotonic()
        try:
            return fn(store)
        finally:
            self._call_started = None

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("world %s: heartbeat crashed", self.world)
        finally:
            STALL_WATCH.discard(self)
            # Drop this thread's store client here, never on a caller's thread.
            self._store = None

    def _loop(self) -> None:
        peers = [r for r in range(self._size) if r != self._rank]
        seen: dict[int, bytes] = {}
        changed = dict.fromkeys(peers, time.monotonic())
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            verdict = self._outbox
            if verdict is not None:
                try:
                    self._call(lambda s: s.compare_set(self._abort_key, "", verdict.encode()))
                except Exception as exc:
                    log.debug("world %s: could not publish verdict: %s", self.world, short(exc))
                return
            if self._stopping:
                return
            if self._failed:
                continue  # wait for the world's verdict or stop
            try:
                values = self._call(self._tick)
            except Exception as exc:
                self._fail(f"the world's store is unreachable: {short(exc)}", 0)
                continue
            assert isinstance(values, list)
            self._judge(values, peers, seen, changed)

    def _tick(self, store: HeartbeatStore) -> list[bytes]:
        store.add(self._own_key, 1)
        return store.multi_get(self._keys)

    def _judge(self, values: list[bytes], peers: list[int], seen: dict[int, bytes], changed: dict[int, float]) -> None:
        raw_verdict, raw_epoch = values[self._size], values[self._size + 1]
        if raw_verdict:
            verdict = Verdict.decode(raw_verdict)
            self._fail(verdict.describe(), verdict.peer_rank, report=not verdict.deliberate)
            return
        current = int(raw_epoch or 0)
        if current > self._epoch:
            self._fail(f"superseded by epoch {current}", None, report=False)
            return
        now = time.monotonic()
        for peer in peers:
            if values[peer] != seen.get(peer):
                seen[peer] = values[peer]
                changed[peer] = now
            elif now - changed[peer] > self.dead_after:
                self._fail(f"rank {peer} sent no heartbeat for {now - changed[peer]:.1f}s", peer, publish=True)
                return


class _StallWatch:
    """One thread for the whole process that only reads timestamps, so it never blocks."""

    PERIOD = 0.05

    def __init__(self) -> None:
        self._beats: set[Heartbeat] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, beat: Heartbeat) -> None:
        with self._cond:
            self._beats.add(beat)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mw-stall-watch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def discard(self, beat: Heartbeat) -> None:
        with self._cond:
            self._beats.discard(beat)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._beats:
                    self._cond.wait()
                beats = list(self._beats)
            now = time.monotonic()
            for beat in beats:
                beat.check_stall(now)
            time.sleep(self.PERIOD)


STALL_WATCH = _StallWatch()
