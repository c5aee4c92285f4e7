"""One world at one epoch: its store clients, communicator, heartbeat, breaking and release."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import Backend, PrefixStore, ProcessGroup

from multiworld import shutdown
from multiworld.contract import WorldAssignment
from multiworld.detect.config import DetectConfig
from multiworld.detect.detector import Detector, Watch
from multiworld.detect.verdicts import Verdict
from multiworld.errors import WorldBrokenError, WorldJoinError, short
from multiworld.log_context import WorldLog
from multiworld.world import host_names, stores
from multiworld.world.backends import Driver, make_driver
from multiworld.world.building import BuildWatch
from multiworld.world.ops import Collectives
from multiworld.world.rendezvous import Rendezvous
from multiworld.world.work import InFlight

log = logging.getLogger(__name__)

# on_broken(world, error, report): report is False when this process chose to drop the world.
BrokenCallback = Callable[["World", WorldBrokenError, bool], None]


class World(Collectives):
    """A joined world. Ops are methods (see ops.py); a broken world raises WorldBrokenError
    from every op, pending or new, and releases itself in the background. Its manager drops
    it with `close` or `leave_for_good`."""

    def __init__(
        self,
        assignment: WorldAssignment,
        *,
        pg: ProcessGroup,
        driver: Driver,
        store: Any,
        config: DetectConfig,
        on_broken: BrokenCallback,
    ) -> None:
        self.assignment = assignment
        self.epoch = assignment.epoch
        self._log = WorldLog(log, assignment.name, assignment.epoch)
        self.backend = assignment.backend
        self._pg: ProcessGroup | None = pg
        self._comm: Backend | None = pg._get_backend(driver.device or torch.device("cpu"))
        self._lock = threading.Lock()
        in_flight = InFlight(assignment.name, assignment.epoch, self._lock, self._op_failed)
        super().__init__(assignment.name, assignment.rank, assignment.size, self._comm, driver, in_flight)
        self._tick_s = config.heartbeat_interval
        self._on_broken = on_broken
        self._released = threading.Event()
        self._published = False
        self._heartbeat = Watch(
            world=self.name,
            epoch=self.epoch,
            rank=self.rank,
            prefix=assignment.store_prefix,
            config=config,
            world_store=store,
            on_failure=self._heartbeat_failed,
            reads_epoch=not assignment.secret,
        )

    def __repr__(self) -> str:
        state = f"broken: {self._error.reason}" if self._error else "healthy"
        return f"<World {self.name!r} epoch {self.epoch} rank {self.rank}/{self.size} {self.backend} {state}>"

    @property
    def broken(self) -> bool:
        """True once the world broke (every op on it raises WorldBrokenError from then on)."""
        return self._error is not None

    @property
    def error(self) -> WorldBrokenError | None:
        """Why the world broke (None while healthy)."""
        return self._error

    @property
    def communicator(self) -> Backend | None:
        """The world's own torch communicator (a ProcessGroup backend), for what the library does
        not wrap; None once released. The library does not track ops called on it directly: one
        that fails raises torch's own error, and the world breaks when the heartbeats or a
        library op see the failure."""
        return self._comm

    @property
    def released(self) -> bool:
        """True once the communicator is aborted and dropped."""
        return self._released.is_set()

    def wait_released(self, timeout: float | None = None) -> bool:
        """Wait until the communicator is aborted and dropped."""
        return self._released.wait(timeout)

    def _op_failed(self, op: str, exc: BaseException) -> WorldBrokenError:
        """An op failed: the communicator is unusable, so the whole world is broken."""
        return self._break(f"{op} failed: {short(exc)}", None, publish=True, report=True)

    def _heartbeat_failed(self, reason: str, peer_rank: int | None, publish: bool, report: bool) -> None:
        self._break(reason, peer_rank, publish=publish, report=report)

    def close(self, reason: str, *, release: bool = True) -> None:
        """This process drops the world on purpose (its manager: a newer epoch, a join called
        off, shutdown); the peers read a deliberate verdict. With release=False the caller
        releases it, together with others (see release_in_background)."""
        self._break(f"rank {self.rank} {reason}", None, publish=True, report=False, release=release)

    def leave_for_good(self, reason: str) -> None:
        """Close (its manager's leave), and stop serving the world's store once the peers could
        read the verdict (unless this process asked for that store again by then)."""
        self.close(reason)
        if self.rank == 0:
            shutdown.start_thread(self._stop_serving, f"mw-unserve-{self.name}", stores.asked(self.assignment.port))

    def _stop_serving(self, asked: int) -> None:
        self._heartbeat.join(self._heartbeat.dead_after)
        # The peers read the verdict on their next tick; a store gone before that would tell
        # them only that it is unreachable (a failure, where this was a deliberate leave).
        time.sleep(2 * self._tick_s)
        stores.stop_serving(self.name, self.assignment.port, unless_asked_since=asked)

    def _break(
        self, reason: str, peer_rank: int | None, *, publish: bool, report: bool, release: bool = True
    ) -> WorldBrokenError:
        """Mark the world broken (first verdict wins), fail what is pending, tell the peers and
        the manager, and release in the background. Never blocks."""
        with self._lock:
            if self._error is not None:
                return self._error
            error = WorldBrokenError(self.name, self.epoch, reason, peer_rank)
            pending = self._refuse(error)
            comm = self._comm
        (self._log.warning if report else self._log.info)("%s", error)
        # A copy: an op that read the works in flight before _refuse may still add to them (it
        # then sees _error and fails its work itself).
        for work in list(pending):
            work.settle(error)
        if publish:
            self._published = True
            # A deliberate drop (not reported here) names this rank as the one that went.
            deliberate = not report
            verdict = Verdict(
                reason=reason,
                peer_rank=self.rank if deliberate else peer_rank,
                by_rank=self.rank,
                deliberate=deliberate,
            )
            self._heartbeat.publish(verdict)
        else:
            self._heartbeat.stop()
        if comm is not None:
            # Callers blocked in this world's ops are freed by ending its communicator's ops.
            # Peers that may still be alive get a tick to read the verdict first: connections
            # closed under their ops would tell them only "connection closed", and would make
            # a deliberate leave look like a failure.
            peers_alive = self.size - 1 - (1 if report and peer_rank is not None else 0)
            shutdown.start_thread(self._free_blocked, f"mw-interrupt-{self.name}", comm, peers_alive > 0)
        try:
            self._on_broken(self, error, report)
        finally:
            if release:
                release_in_background([self])
        return error

    def _free_blocked(self, comm: Backend, tell_peers: bool) -> None:
        """End every op in flight on the communicator, and so every wait on one."""
        if tell_peers:
            self._heartbeat.join(self._tick_s)  # the verdict is written (bounded: a frozen store)
            time.sleep(self._tick_s)
        self._driver.interrupt(comm, self.rank, self.size)

    def _verdict_written(self) -> None:
        """Wait (bounded) until the heartbeat has written this member's verdict, if any."""
        if self._published:
            self._heartbeat.join(self._heartbeat.dead_after)

    def _take_pg(self) -> ProcessGroup | None:
        with self._lock:
            pg, self._pg, self._comm = self._pg, None, None
        if self._waiters is not None:
            self._waiters.stop()
        return pg


def form_world(
    assignment: WorldAssignment,
    *,
    pod: str,
    config: DetectConfig,
    detector: Detector,
    device: str | torch.device | None,
    cancelled: threading.Event,
    on_broken: BrokenCallback,
    deadline: float,
) -> World:
    """Rendezvous with the other members of this epoch and build the world (blocking) by
    `deadline` (monotonic); its failures are watched by `detector` unless `config.heartbeat` is
    off."""
    a = assignment
    driver = make_driver(a.backend, device)
    # Each stage of the join, at debug with the seconds since it began: where a slow join waits.
    stages = WorldLog(log, a.name, a.epoch)
    began = time.monotonic()
    host = host_names.qualified(a.host)

    def client() -> Any:
        return stores.open_client(
            a.name, a.rank, host, a.port, deadline=deadline, cancelled=cancelled, wait_timeout=config.join_timeout
        )

    store = client()
    # The build watch's client is connected before the rendezvous: once past it the others
    # judge this member's silence, and a connect may be slow (a peer's retries, a busy core).
    watch_store = client() if config.heartbeat else None
    stages.debug("reached the store at %s:%d as rank %d (%.2f s)", host, a.port, a.rank, time.monotonic() - began)
    beat = detector.announce(host if a.rank == 0 else None) if config.heartbeat else None
    members = Rendezvous(store, a, pod=pod, deadline=deadline, cancelled=cancelled, beat=beat).run()
    stages.debug("every member of the epoch is present (%.2f s)", time.monotonic() - began)
    linked = config.heartbeat and a.rank != 0

    def build() -> ProcessGroup:
        if linked:
            detector.connect_link(host, members[0], timeout=max(deadline - time.monotonic(), 1.0))
            stages.debug("linked to rank 0's heartbeats (%.2f s)", time.monotonic() - began)
        try:
            return driver.build(
                PrefixStore(f"{a.store_prefix}pg/", store),
                a.rank,
                a.size,
                timedelta(seconds=config.op_timeout),
                f"{a.name}:{a.epoch}",
            )
        except BaseException:
            if linked:
                detector.unpin(host, members[0])
            raise

    def discard(pg: ProcessGroup) -> None:
        """A build that ended after its join gave it up: nothing will watch its world."""
        if linked:
            detector.unpin(host, members[0])
        driver.abort([pg])

    try:
        if watch_store is not None:
            pods = [str(m.get("pod") or "") for m in members]
            pg = BuildWatch(watch_store, a, pods, config, cancelled).run(build, discard)
        else:
            pg = build()
    except RuntimeError as exc:  # the backend's own failure (a timeout, a peer that refused)
        raise WorldJoinError(
            f"world {a.name!r} epoch {a.epoch}: building the communicator failed: {short(exc)}"
        ) from exc
    stages.debug("communicator built (%.2f s)", time.monotonic() - began)
    world = World(a, pg=pg, driver=driver, store=store, config=config, on_broken=on_broken)
    if config.heartbeat:
        detector.watch(world._heartbeat, members, host)
    world._log.info("joined as rank %d of %d (%s)", a.rank, a.size, a.backend)
    return world


def release_in_background(worlds: list[World]) -> None:
    """Abort the worlds' communicators and drop them on daemon threads.

    Dropping the last reference to a gloo group with an op stuck on a silent peer blocks until
    the op times out, so that never happens on a caller's thread, and never holds up process
    exit either (see shutdown.py).
    """
    shutdown.start_thread(_release, "mw-release", worlds)


def _release(worlds: list[World]) -> None:
    # Each communicator lives only in its one-element holder, so the thread that empties the
    # holder is the one that runs its destructor.
    # Before aborting, give the peers a couple of heartbeat ticks to read the verdict (or the
    # newer epoch) from the store, so they learn why rather than just see connections close.
    for world in worlds:
        world._verdict_written()
    time.sleep(2 * max(world._tick_s for world in worlds))
    held: list[tuple[World, list[ProcessGroup]]] = []
    for world in worlds:
        # None: an earlier release took it, and that one sets `_released` when done.
        holder = [pg for pg in (world._take_pg(),) if pg is not None]
        if holder:
            held.append((world, holder))
    # One abort call per backend and device, so NCCL communicators are aborted as one group.
    groups: dict[tuple[str, str], list[tuple[World, list[ProcessGroup]]]] = {}
    for world, holder in held:
        groups.setdefault((world._driver.name, str(world._driver.device)), []).append((world, holder))
    for members in groups.values():
        driver = members[0][0]._driver
        try:
            driver.abort([holder[0] for _, holder in members])
        except Exception as exc:
            log.warning("aborting %s communicators failed: %s", driver.name, short(exc))
    groups.clear()
    for world, holder in held:
        shutdown.start_thread(_drop, f"mw-drop-{world.name}", world, holder)
    held.clear()


def _drop(world: World, holder: list[ProcessGroup]) -> None:
    holder.clear()  # the last reference: may block until a stuck op times out
    world._released.set()
    world._log.debug("released")
