"""Many worlds in one process: join, leave, follow the live world table, report failures.
The same class serves pymultiworld's API (compat.py).

No torch at import: the communicator code (world.py) loads on the first join.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from multiworld import shutdown
from multiworld.channels import Channel
from multiworld.channels.none import NoneChannel
from multiworld.compat import PymultiworldFace
from multiworld.contract import JOIN_FAILED, BrokenWorldReport, WorkerStatus, WorldAssignment, WorldTable
from multiworld.detect_config import DetectConfig
from multiworld.detector import Detector, HeartbeatLoad
from multiworld.errors import (
    JoinCancelled,
    JoinTimedOut,
    StaleEpochError,
    UnknownWorldError,
    WorldBrokenError,
    WorldJoinError,
)

if TYPE_CHECKING:
    import torch

    from multiworld.world import World

log = logging.getLogger(__name__)


class _Join:
    """One rendezvous in flight on its own daemon thread. `config` and `device`: this join's
    own, where they differ from the manager's (None: the manager's)."""

    def __init__(
        self,
        assignment: WorldAssignment,
        config: DetectConfig | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        self.assignment = assignment
        self.config = config
        self.device = device
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.world: World | None = None
        self.error: BaseException | None = None

    @classmethod
    def holding(cls, world: World) -> _Join:
        """A finished join of a world already held."""
        join = cls(world.assignment)
        join.world = world
        join.done.set()
        return join

    def result(self) -> World:
        if self.error is not None:
            raise self.error
        assert self.world is not None
        return self.world


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class WorldManager(PymultiworldFace):
    """The worlds of one process (pod). Thread-safe; never blocks on a broken world."""

    def __init__(
        self,
        pod: str = "",
        config: DetectConfig | None = None,
        channel: Channel | None = None,
        device: str | torch.device | None = None,
        instance: Mapping[str, int] | None = None,
        *,
        enable_monitor: bool = True,
        spare: bool = False,
    ) -> None:
        """`instance`: the epochs (world -> epoch) this process's pod was created for, as its
        environment gives them; a table that names a newer instance of the pod is not followed.
        `enable_monitor=False` (pymultiworld's name): worlds run no heartbeat; op errors still
        break them. `spare`: a warm spare, which says at once that it waits for an identity and
        takes the one the first live table naming its pod gives it."""
        if not isinstance(pod, str):
            raise TypeError(f"pod must be a str, got {pod!r} (pymultiworld's enable_monitor is a keyword argument)")
        self.pod = pod or socket.gethostname()
        self._instance = dict(instance or {})
        self._replaced = False
        self._started = datetime.now(UTC)
        self._joined_at: dict[str, datetime] = {}
        self.config = config if config is not None else DetectConfig.from_env()
        if not enable_monitor:
            self.config = self.config.model_copy(update={"heartbeat": False})
        self._channel: Channel = channel if channel is not None else NoneChannel()
        self._follows_table = channel is not None and not isinstance(channel, NoneChannel)
        self._device = device
        self._lock = threading.RLock()
        self._worlds: dict[str, World] = {}
        self._joins: dict[str, _Join] = {}
        self._given_up: dict[str, int] = {}  # the epoch per world whose join failed: not retried
        self._errors: dict[str, int] = {}
        self._revision = -1
        # Called once at the next change, outside the lock; what they return is ignored.
        self._watchers: list[Callable[[], object]] = []
        self._last_status: WorkerStatus | None = None
        self._closed = False
        self._waiting = spare
        self._plays = ""  # the member pod a spare plays, once it has an identity
        # One failure detector for all of this process's worlds (see detector.py).
        self._detector = Detector()
        _open_managers.add(self)
        # The exit hooks come with the first manager: importing the library changes nothing.
        shutdown.on_exit(_close_open_managers)
        self._channel.start(self.apply)
        if spare:
            self._changed()  # the platform gives identities only to spares that said they wait

    def __enter__(self) -> WorldManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def plays(self) -> str:
        """The member pod this process plays: its own, unless it is a spare given an identity."""
        return self._plays or self.pod

    def __repr__(self) -> str:
        return f"<WorldManager pod={self.pod!r} worlds={sorted(self._worlds)} joining={sorted(self._joins)}>"

    # -- joining -----------------------------------------------------------------------

    def join(
        self,
        assignment: WorldAssignment | Mapping[str, Any],
        *,
        config: DetectConfig | None = None,
        device: str | torch.device | None = None,
    ) -> World:
        """Rendezvous with the world's other members (blocking) and return the world.
        `config`, `device`: this world's own (default: the manager's)."""
        join = self._start_join(_assignment(assignment), config, device)
        join.done.wait()
        return join.result()

    async def join_async(
        self,
        assignment: WorldAssignment | Mapping[str, Any],
        *,
        config: DetectConfig | None = None,
        device: str | torch.device | None = None,
    ) -> World:
        """`join` without blocking the event loop."""
        join = self._start_join(_assignment(assignment), config, device)
        await self._until(join.done.is_set, None, f"join of world {join.assignment.name!r}")
        return join.result()

    def join_all(self, assignments: Iterable[WorldAssignment]) -> dict[str, World]:
        """Join several worlds in parallel (a process can wait on another in one world while that
        one waits on it in another). Returns the worlds joined; failures are logged and reported."""
        joins = self.start_joins(assignments)
        for join in joins:
            join.done.wait()
        return {j.assignment.name: j.world for j in joins if j.world is not None}

    def start_joins(self, assignments: Iterable[WorldAssignment], *, newest_only: bool = False) -> list[_Join]:
        """Start joining each world in the background and return the joins (init_from_env).
        newest_only: an assignment older than the
        epoch this manager already holds or joins for that world is left out (StaleEpochError
        otherwise), and that newer join is returned in its place."""
        joins = []
        for a in assignments:
            try:
                joins.append(self._start_join(_assignment(a)))
            except StaleEpochError:
                if not newest_only:
                    raise
                with self._lock:
                    newer = self._joins.get(a.name)
                    held = self._worlds.get(a.name)
                if newer is None and held is not None:
                    newer = _Join.holding(held)
                if newer is not None:
                    joins.append(newer)
        return joins

    def _start_join(
        self, a: WorldAssignment, config: DetectConfig | None = None, device: str | torch.device | None = None
    ) -> _Join:
        with self._lock:
            if self._closed:
                raise RuntimeError("this WorldManager is closed")
            pending = self._joins.get(a.name)
            if pending is not None:
                if pending.assignment == a:
                    return pending
                self._refuse_older(a, pending.assignment, "being joined")
                pending.cancelled.set()
                del self._joins[a.name]
            held = self._worlds.get(a.name)
            if held is not None:
                if held.assignment == a and not held.broken:
                    return _Join.holding(held)
                if held.assignment == a:
                    raise WorldJoinError(
                        f"world {a.name!r} epoch {a.epoch} is broken ({held.error.reason if held.error else ''}); "
                        "join a newer epoch"
                    )
                self._refuse_older(a, held.assignment, "held")
                if not held.broken:
                    held.close(f"moved on to epoch {a.epoch}")
            return self._launch(a, config, device)

    def _launch(
        self, a: WorldAssignment, config: DetectConfig | None = None, device: str | torch.device | None = None
    ) -> _Join:
        """Register a join of `a` (under the lock) and run it on its own thread."""
        join = _Join(a, config, device)
        self._joins[a.name] = join
        shutdown.start_thread(self._run_join, f"mw-join-{a.name}-{a.epoch}", join)
        return join

    @staticmethod
    def _refuse_older(a: WorldAssignment, current: WorldAssignment, state: str) -> None:
        if current.epoch > a.epoch:
            raise StaleEpochError(f"world {a.name!r}: epoch {a.epoch} is older than epoch {current.epoch}, {state}")
        if current.epoch == a.epoch:
            raise WorldJoinError(
                f"world {a.name!r} epoch {a.epoch} is already {state} as rank {current.rank} of {current.size} "
                f"at {current.host}:{current.port}; a changed world needs a new epoch"
            )

    def _run_join(self, join: _Join) -> None:
        from multiworld.world import form_world

        try:
            world = form_world(
                join.assignment,
                pod=self.pod,
                config=join.config or self.config,
                device=join.device if join.device is not None else self._device,
                detector=self._detector,
                cancelled=join.cancelled,
                on_broken=self._world_broken,
            )
        except BaseException as exc:
            self._join_failed(join, exc)
        else:
            self._install(join, world)

    def _install(self, join: _Join, world: World) -> None:
        name = join.assignment.name
        with self._lock:
            current = self._joins.get(name) is join and not join.cancelled.is_set() and not self._closed
            if current:
                del self._joins[name]
                self._worlds[name] = world
                self._joined_at[name] = datetime.now(UTC)
                join.world = world
        if not current:
            world.close("cancelled its join")
            join.error = JoinCancelled(name)
            self.unserve_if_unused(join.assignment)
        join.done.set()
        self._changed()

    def _join_failed(self, join: _Join, exc: BaseException) -> None:
        a = join.assignment
        join.error = exc
        with self._lock:
            current = self._joins.get(a.name) is join
            # Following a live table, a join that timed out goes on waiting (a peer's pod may be
            # scheduling or pulling its image); the platform decides from the report whether
            # the epoch failed, and a newer epoch calls this join off.
            again = current and isinstance(exc, JoinTimedOut) and self._follows_table and not self._closed
            if current:
                del self._joins[a.name]
                if again:
                    self._launch(a, join.config, join.device)
                else:
                    self._given_up[a.name] = max(self._given_up.get(a.name, 0), a.epoch)
        if current and not isinstance(exc, (JoinCancelled, StaleEpochError)):
            log.warning("could not join world %s epoch %d: %s", a.name, a.epoch, exc)
            self._channel.report(
                BrokenWorldReport(
                    world=a.name, epoch=a.epoch, reason=f"{JOIN_FAILED}{exc}", pod=self.pod, plays=self._plays
                )
            )
        elif current:
            log.info("gave up joining world %s epoch %d: %s", a.name, a.epoch, exc)
        self.unserve_if_unused(a)
        join.done.set()
        self._changed()

    def unserve_if_unused(self, a: WorldAssignment) -> None:
        """After a rank-0 join (or pymultiworld's read of its store) failed or was called off:
        stop the store server it started, unless a newer join or a held world of this process
        serves on that port. Under the lock, so no join can start reusing the server in between."""
        if a.rank != 0:
            return
        from multiworld import stores

        with self._lock:
            users = [j.assignment for j in self._joins.values()] + [w.assignment for w in self._worlds.values()]
            if not any(u.rank == 0 and u.port == a.port for u in users):
                stores.stop_serving(a.name, a.port)

    # -- the live table ------------------------------------------------------------------

    def apply(self, table: WorldTable | Mapping[str, Any]) -> None:
        """Match the table: join new worlds and newer epochs (in the background), leave worlds
        that are gone. Older revisions are ignored. Never blocks."""
        table = table if isinstance(table, WorldTable) else WorldTable.model_validate(table)
        if table.revision == 0 and not table.worlds:
            # The default table: a platform that has published nothing yet, not "no worlds".
            return
        with self._lock:
            if self._closed:
                return
            if table.revision < self._revision:
                log.debug("ignoring world table revision %d (have %d)", table.revision, self._revision)
                return
            self._revision = table.revision
            if self._replaced or self._superseded(table):
                return
            mine = table.assignments_for(self.pod)
            identified = self._waiting and bool(mine)
            if identified:
                self._waiting = False
                self._plays = table.plays(self.pod)
                log.info("spare pod %s plays %s from world table revision %d", self.pod, self._plays, table.revision)
            for name in (set(self._worlds) | set(self._joins)) - set(mine):
                self._leave(name)
            for a in mine.values():
                if self._wants(a):
                    try:
                        self._start_join(a)
                    except WorldJoinError as exc:
                        log.warning("world table revision %d: %s", table.revision, exc)
        # Tells the platform that this process is joining the new epochs (it is alive and
        # follows the table), and a spare's identity.
        self._changed()

    def _superseded(self, table: WorldTable) -> bool:
        """Whether the table gives this pod's ranks to a newer instance of it; then leave every
        world for good (the platform is stopping this process)."""
        worlds = table.replaced(self.pod, self._instance)
        if not worlds:
            return False
        log.warning(
            "pod %s was replaced by a newer instance (worlds %s): this process joins nothing more",
            self.pod,
            ", ".join(worlds),
        )
        self._replaced = True
        for name in set(self._worlds) | set(self._joins):
            self._leave(name)
        return True

    def wait_for_identity(self) -> list[_Join]:
        """A spare's wait (init_from_env): block until the live table gives this spare an
        identity; then the joins that table started (and any world they already gave). A lock's
        wait is interruptible on POSIX, so SIGINT and SIGTERM handlers still run while the main
        thread blocks here."""
        while True:
            woken = threading.Event()
            with self._lock:
                if not self._waiting:
                    return [*self._joins.values(), *map(_Join.holding, self._worlds.values())]
                self._check_open()
                self._watchers.append(woken.set)
            woken.wait()

    def _wants(self, a: WorldAssignment) -> bool:
        pending = self._joins.get(a.name)
        current = pending.assignment if pending is not None else None
        held = self._worlds.get(a.name)
        if current is None and held is not None:
            current = held.assignment
        if current is not None and current.epoch >= a.epoch:
            if current.epoch == a.epoch and current != a:
                log.error("world %s epoch %d changed without a new epoch; ignored", a.name, a.epoch)
            return False
        return self._given_up.get(a.name, 0) < a.epoch

    # -- leaving -------------------------------------------------------------------------

    def leave(self, name: str) -> None:
        """Leave a world (or call off its join). Its release runs in the background."""
        with self._lock:
            if name not in self._worlds and name not in self._joins:
                raise UnknownWorldError(name, self._known())
            self._leave(name)

    def _leave(self, name: str) -> None:
        join = self._joins.pop(name, None)
        if join is not None:
            join.cancelled.set()
        world = self._worlds.pop(name, None)
        if world is not None:
            world.leave_for_good("left the world")
        self._changed()

    # -- looking worlds up ---------------------------------------------------------------

    def world(self, name: str) -> World:
        """The world's latest incarnation here (a broken one until a newer epoch is joined)."""
        with self._lock:
            world = self._worlds.get(name)
            if world is None:
                join = self._joins.get(name)
                detail = f"its join (epoch {join.assignment.epoch}) is in progress" if join else self._known()
                raise UnknownWorldError(name, detail)
            return world

    def worlds(self) -> dict[str, World]:
        with self._lock:
            return dict(self._worlds)

    def _known(self) -> str:
        held = sorted(set(self._worlds) | set(self._joins))
        return f"this process holds {', '.join(repr(n) for n in held)}" if held else "this process holds no world"

    def _ready(self, name: str, newer_than: int | None) -> World | None:
        world = self._worlds.get(name)
        if world is not None and not world.broken and world.epoch > (newer_than or 0):
            return world
        return None

    async def wait_world(self, name: str, newer_than: int | None = None, timeout: float | None = None) -> World:
        """Until the world is held healthy at an epoch above `newer_than` (None: any epoch)."""
        found: list[World] = []

        def ready() -> bool:
            world = self._ready(name, newer_than)
            if world is not None:
                found.append(world)
            return world is not None

        await self._until(ready, timeout, f"world {name!r} (epoch > {newer_than or 0})")
        return found[-1]

    def wait_world_blocking(self, name: str, newer_than: int | None = None, timeout: float | None = None) -> World:
        """`wait_world` for code without an event loop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            woken = threading.Event()
            with self._lock:
                world = self._ready(name, newer_than)
                if world is not None:
                    return world
                self._check_open()
                self._watchers.append(woken.set)
            remaining = None if deadline is None else deadline - time.monotonic()
            if (remaining is not None and remaining <= 0) or not woken.wait(remaining):
                raise TimeoutError(f"world {name!r} (epoch > {newer_than or 0}) not ready after {timeout}s")

    async def _until(self, predicate: Callable[[], bool], timeout: float | None, what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            fut: asyncio.Future[None] = loop.create_future()
            with self._lock:
                if predicate():
                    return
                self._check_open()
                self._watchers.append(functools.partial(loop.call_soon_threadsafe, _wake, fut))
            remaining = None if deadline is None else deadline - loop.time()
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                raise TimeoutError(f"{what} not ready after {timeout}s") from None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this WorldManager is closed")

    # -- failures and status -------------------------------------------------------------

    def _world_broken(self, world: World, error: WorldBrokenError, report: bool) -> None:
        if report:
            with self._lock:
                self._errors[world.name] = self._errors.get(world.name, 0) + 1
            self._channel.report(
                BrokenWorldReport(
                    world=error.world,
                    epoch=error.epoch,
                    reason=error.reason,
                    peer_rank=error.peer_rank,
                    pod=self.pod,
                    plays=self._plays,
                )
            )
        self._changed()

    def heartbeat_load(self) -> HeartbeatLoad:
        """What this process's failure detection asked of stores so far (ticks, calls, keys)."""
        return self._detector.load()

    def status(self) -> WorkerStatus:
        """What this process holds now: healthy worlds' epochs, and failures seen per world."""
        with self._lock:
            joined = {name: w.epoch for name, w in self._worlds.items() if not w.broken}
            return WorkerStatus(
                pod=self.pod,
                joined=joined,
                joining={name: j.assignment.epoch for name, j in self._joins.items()},
                errors=dict(self._errors),
                started=self._started,
                joined_at={name: self._joined_at[name] for name in joined},
                waiting=self._waiting,
                plays=self._plays,
            )

    def _changed(self) -> None:
        with self._lock:
            status = self.status()
            if status != self._last_status:
                self._last_status = status
                self._channel.status(status)  # queued, so order is kept under the lock
            watchers, self._watchers = self._watchers, []
        for wake in watchers:
            try:
                wake()
            except RuntimeError:  # an event loop that is gone
                pass

    # -- shutdown ------------------------------------------------------------------------

    def close(self) -> None:
        """Leave every world and call off every join, without waiting for anything: the
        communicators are released in the background (and process exit waits for them,
        bounded; see shutdown.py)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worlds = list(self._worlds.values())
            joins = list(self._joins.values())
            self._worlds.clear()
            self._joins.clear()
        for join in joins:
            join.cancelled.set()
        if worlds:
            from multiworld.world import release_in_background

            for world in worlds:
                world.close("closed", release=False)
            release_in_background(worlds)  # together: NCCL communicators abort as one group
        self._changed()
        self._detector.close()
        self._channel.close()
        _open_managers.discard(self)


def _assignment(value: WorldAssignment | Mapping[str, Any]) -> WorldAssignment:
    return value if isinstance(value, WorldAssignment) else WorldAssignment.model_validate(value)


_open_managers: weakref.WeakSet[WorldManager] = weakref.WeakSet()


def _close_open_managers() -> None:
    for manager in list(_open_managers):
        manager.close()
