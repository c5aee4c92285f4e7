"""Many worlds in one process: the public `WorldManager`, which joins worlds, leaves them, follows
the live world table and reports failures. The same class serves pymultiworld's API (compat.py).

Its parts, each in its own module, share what it holds (holdings.py): joining worlds
(joining.py), following the world table (table_following.py), waiting for worlds (waiting.py)
and the worker's status and reports (worker_status.py). Leaving and shutdown are here.

No torch at import: the communicator code (world/core.py) loads on the first join.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from multiworld import metrics, shutdown
from multiworld.channels import Channel
from multiworld.channels.none import NoneChannel
from multiworld.contract import WorkerStatus, WorldAssignment, WorldTable, metrics_port_from_env
from multiworld.detect.config import DetectConfig
from multiworld.detect.detector import Detector, HeartbeatLoad
from multiworld.errors import UnknownWorldError
from multiworld.membership.holdings import Holdings, Join
from multiworld.membership.joining import Joiner, as_assignment
from multiworld.membership.table_following import TableFollower
from multiworld.membership.waiting import Waits
from multiworld.membership.worker_status import StatusReporter
from multiworld.pymultiworld.compat import PymultiworldFace

if TYPE_CHECKING:
    import torch

    from multiworld.world.core import World


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
        metrics_port: int | None = None,
    ) -> None:
        """`instance`: the epochs (world -> epoch) this process's pod was created for, as its
        environment gives them; a table that names a newer instance of the pod is not followed.
        `enable_monitor=False` (pymultiworld's name): worlds run no heartbeat; op errors still
        break them. `spare`: a warm spare, which says at once that it waits for an identity and
        takes the one the first live table naming its pod gives it. `metrics_port`: this
        process serves its metrics there from now on (see metrics.py); None: on the port
        MULTIWORLD_METRICS_PORT gives, if set."""
        if not isinstance(pod, str):
            raise TypeError(f"pod must be a str, got {pod!r} (pymultiworld's enable_monitor is a keyword argument)")
        if metrics_port is None:
            metrics_port = metrics_port_from_env(os.environ)
        self.pod = pod or socket.gethostname()
        config = config if config is not None else DetectConfig.from_env()
        if not enable_monitor:
            config = config.model_copy(update={"heartbeat": False})
        self._channel: Channel = channel if channel is not None else NoneChannel()
        self._held = Holdings(spare=spare)
        self._reporter = StatusReporter(self._held, self._channel, self.pod)
        self._waits = Waits(self._held)
        # One failure detector for all of this process's worlds (see detector.py).
        self._detector = Detector()
        self._joiner = Joiner(
            self._held,
            self._reporter,
            pod=self.pod,
            config=config,
            device=device,
            detector=self._detector,
            follows_table=channel is not None and not isinstance(channel, NoneChannel),
        )
        self._table = TableFollower(
            self._held, self._joiner, self._reporter, pod=self.pod, instance=instance, leave=self._leave
        )
        # Before the channel starts: a table it brings may start joins, and each world joined
        # records its ops if the metrics are served by then.
        if metrics_port is not None:
            metrics.serve(metrics_port)
        _open_managers.add(self)
        # The exit hooks come with the first manager: importing the library changes nothing.
        shutdown.on_exit(_close_open_managers)
        self._channel.start(self.apply)
        if spare:
            self._reporter.changed()  # the platform gives identities only to spares that said they wait

    def __enter__(self) -> WorldManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def config(self) -> DetectConfig:
        """The detection settings of the worlds joined without settings of their own."""
        return self._joiner.config

    @config.setter
    def config(self, config: DetectConfig) -> None:
        self._joiner.config = config

    @property
    def plays(self) -> str:
        """The member pod this process plays: its own, unless it is a spare given an identity."""
        return self._held.plays or self.pod

    def __repr__(self) -> str:
        held = self._held
        return f"<WorldManager pod={self.pod!r} worlds={sorted(held.worlds())} joining={sorted(held.joins())}>"

    # -- joining (joining.py) --------------------------------------------------------------

    def join(
        self,
        assignment: WorldAssignment | Mapping[str, Any],
        *,
        config: DetectConfig | None = None,
        device: str | torch.device | None = None,
    ) -> World:
        """Rendezvous with the world's other members (blocking) and return the world.
        `config`, `device`: this world's own (default: the manager's). WorldJoinError when the
        rendezvous fails (JoinTimedOut, StaleEpochError among them); RuntimeError once closed."""
        join = self._joiner.start(as_assignment(assignment), config, device)
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
        join = self._joiner.start(as_assignment(assignment), config, device)
        await self._waits.until(join.done.is_set, None, f"join of world {join.assignment.name!r}")
        return join.result()

    def join_all(self, assignments: Iterable[WorldAssignment]) -> dict[str, World]:
        """Join several worlds in parallel (a process can wait on another in one world while that
        one waits on it in another). Returns the worlds joined; failures are logged and reported."""
        joins = self._joiner.start_all(assignments)
        for join in joins:
            join.done.wait()
        return {j.assignment.name: j.world for j in joins if j.world is not None}

    def start_joins(self, assignments: Iterable[WorldAssignment], *, newest_only: bool = False) -> list[Join]:
        """Start joining each world in the background and return the joins (init_from_env).
        newest_only: an assignment older than the epoch this manager already holds or joins
        for that world is left out (StaleEpochError otherwise), and that newer join is returned
        in its place."""
        return self._joiner.start_all(assignments, newest_only=newest_only)

    def unserve_if_unused(self, a: WorldAssignment) -> None:
        """Stop serving the store that rank 0 of `a` started, unless a join or a world of this
        process serves on its port (after a join of `a`, or a read of its store, failed)."""
        self._joiner.unserve_if_unused(a)

    # -- the live table (table_following.py) -----------------------------------------------

    def apply(self, table: WorldTable | Mapping[str, Any]) -> None:
        """Match the table: join new worlds and newer epochs (in the background), leave worlds
        that are gone. Older revisions are ignored. Never blocks."""
        self._table.apply(table)

    def wait_for_identity(self) -> list[Join]:
        """A spare's wait (init_from_env): block until the live table gives this spare an
        identity; then the joins that table started (and any world they already gave)."""
        held = self._held
        found: list[list[Join]] = []

        def identified() -> bool:
            if held.waiting:
                return False
            found.append([*held.joins().values(), *map(Join.holding, held.worlds().values())])
            return True

        self._waits.until_blocking(identified, None, "an identity")
        return found[-1]

    # -- leaving ---------------------------------------------------------------------------

    def leave(self, name: str) -> None:
        """Leave a world (or call off its join). Its release runs in the background."""
        held = self._held
        with held.lock:
            if name not in held.names():
                raise UnknownWorldError(name, held.known())
            self._leave(name)

    def _leave(self, name: str) -> None:
        """Leave a world or call off its join, under the lock (also the table's leave)."""
        world = self._held.forget(name)
        if world is not None:
            world.leave_for_good("left the world")
        self._reporter.changed()

    # -- looking worlds up (waiting.py) ----------------------------------------------------

    def world(self, name: str) -> World:
        """The world's latest incarnation here (a broken one until a newer epoch is joined)."""
        held = self._held
        with held.lock:
            world = held.world(name)
            if world is None:
                join = held.joining(name)
                detail = f"its join (epoch {join.assignment.epoch}) is in progress" if join else held.known()
                raise UnknownWorldError(name, detail)
            return world

    def worlds(self) -> dict[str, World]:
        """The worlds joined, by name: each one's latest incarnation (broken ones included). A
        world whose join is under way is not here yet: `world_names` lists it."""
        return self._held.worlds()

    def world_names(self) -> list[str]:
        """The worlds this process is in, sorted: those joined (healthy or broken) and those
        whose join is under way (at start, or a world the live table added)."""
        return sorted(self._held.names())

    def assignments(self) -> dict[str, WorldAssignment]:
        """Every world this process is in, by name: the latest assignment (rank, size, epoch,
        store) of each, those whose join is under way included; waits for nothing."""
        held = self._held
        with held.lock:
            found = {name: world.assignment for name, world in held.worlds().items()}
            found.update({name: join.assignment for name, join in held.joins().items()})
            return found

    async def wait_world(self, name: str, newer_than: int | None = None, timeout: float | None = None) -> World:
        """Until the world is held healthy at an epoch above `newer_than` (None: any epoch).
        TimeoutError after `timeout` seconds (None: no limit, so a world whose peers are gone
        for good is waited for forever); RuntimeError once the manager closes."""
        return await self._waits.world(name, newer_than, timeout)

    def wait_world_blocking(self, name: str, newer_than: int | None = None, timeout: float | None = None) -> World:
        """`wait_world` for code without an event loop."""
        return self._waits.world_blocking(name, newer_than, timeout)

    # -- status (worker_status.py) ---------------------------------------------------------

    def heartbeat_load(self) -> HeartbeatLoad:
        """What this process's failure detection asked of stores so far (ticks, calls, keys)."""
        return self._detector.load()

    def status(self) -> WorkerStatus:
        """What this process holds now: healthy worlds' epochs, and failures seen per world."""
        return self._reporter.status()

    # -- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        """Leave every world and call off every join, without waiting for anything: the
        communicators are released in the background (and process exit waits for them,
        bounded; see shutdown.py)."""
        dropped = self._held.close()
        if dropped is None:
            return
        worlds, joins = dropped
        for join in joins:
            join.cancelled.set()
        if worlds:
            from multiworld.world.core import release_in_background

            for world in worlds:
                world.close("closed", release=False)
            release_in_background(worlds)  # together: NCCL communicators abort as one group
        self._reporter.changed()
        self._detector.close()
        self._channel.close()
        _open_managers.discard(self)


_open_managers: weakref.WeakSet[WorldManager] = weakref.WeakSet()


def _close_open_managers() -> None:
    for manager in list(_open_managers):
        manager.close()
