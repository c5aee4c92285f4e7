"""Joining worlds for a WorldManager: each rendezvous runs on its own daemon thread, a newer
epoch calls an older join off, and the world joined is installed in the manager's holdings.

No torch at import: the communicator code (world/core.py) loads on the first join.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from multiworld import metrics, shutdown
from multiworld.contract import WorldAssignment
from multiworld.detect.config import DetectConfig
from multiworld.detect.detector import Detector
from multiworld.errors import JoinCancelled, JoinTimedOut, StaleEpochError, StoreLost, WorldJoinError
from multiworld.log_context import WorldLog
from multiworld.membership.holdings import Holdings, Join
from multiworld.membership.worker_status import StatusReporter

if TYPE_CHECKING:
    import torch

    from multiworld.world.core import World

log = logging.getLogger(__name__)

# A join that lost its store tries again after this pause, so that a store which fails at once
# (an instance shutting down) is not asked again and again.
RETRY_PAUSE_S = 0.5


def as_assignment(value: WorldAssignment | Mapping[str, Any]) -> WorldAssignment:
    return value if isinstance(value, WorldAssignment) else WorldAssignment.model_validate(value)


class Joiner:
    """Starts and finishes one manager's joins. `config` and `device`: the manager's, for the
    joins that bring none of their own; `follows_table`: a join that timed out goes on waiting
    (the platform decides whether its epoch failed)."""

    def __init__(
        self,
        held: Holdings,
        reporter: StatusReporter,
        *,
        pod: str,
        config: DetectConfig,
        device: str | torch.device | None,
        detector: Detector,
        follows_table: bool,
    ) -> None:
        self._held = held
        self._reporter = reporter
        self._pod = pod
        self.config = config
        self._device = device
        self._detector = detector
        self._follows_table = follows_table

    def start_all(
        self, assignments: Iterable[WorldAssignment | Mapping[str, Any]], *, newest_only: bool = False
    ) -> list[Join]:
        """Start joining each world in the background. newest_only: an assignment older than the
        epoch this manager already holds or joins for that world is left out (StaleEpochError
        otherwise), and that newer join is returned in its place."""
        held = self._held
        joins = []
        for value in assignments:
            a = as_assignment(value)
            try:
                joins.append(self.start(a))
            except StaleEpochError:
                if not newest_only:
                    raise
                with held.lock:
                    newer = held.joining(a.name)
                    world = held.world(a.name)
                if newer is None and world is not None:
                    newer = Join.holding(world)
                if newer is not None:
                    joins.append(newer)
        return joins

    def start(
        self, a: WorldAssignment, config: DetectConfig | None = None, device: str | torch.device | None = None
    ) -> Join:
        """Start joining `a` in the background (or return the join or world that is `a`
        already). A newer epoch calls off the join of an older one, and closes a world held at
        an older one; an older epoch raises StaleEpochError, the same epoch changed
        WorldJoinError."""
        held = self._held
        with held.lock:
            held.check_open()
            pending = held.joining(a.name)
            if pending is not None:
                if pending.assignment == a:
                    return pending
                _refuse_older(a, pending.assignment, "being joined")
                held.call_off(a.name)
            world = held.world(a.name)
            if world is not None:
                if world.assignment == a and not world.broken:
                    return Join.holding(world)
                if world.assignment == a:
                    raise WorldJoinError(
                        f"world {a.name!r} epoch {a.epoch} is broken ({world.error.reason if world.error else ''}); "
                        "join a newer epoch"
                    )
                _refuse_older(a, world.assignment, "held")
                if not world.broken:
                    world.close(f"moved on to epoch {a.epoch}")
            return self._launch(a, config, device)

    def unserve_if_unused(self, a: WorldAssignment) -> None:
        """After a rank-0 join failed or was called off: stop the store server it started,
        unless a newer join or a held world of this process serves on that port. Under the lock,
        so no join can start reusing the server in between."""
        if a.rank != 0:
            return
        from multiworld.world import stores

        held = self._held
        with held.lock:
            users = [j.assignment for j in held.joins().values()] + [w.assignment for w in held.worlds().values()]
            if not any(u.rank == 0 and u.port == a.port for u in users):
                stores.stop_serving(a.name, a.port)

    def _launch(
        self,
        a: WorldAssignment,
        config: DetectConfig | None = None,
        device: str | torch.device | None = None,
        pause: float = 0.0,
        replacing: Join | None = None,
        deadline: float | None = None,
    ) -> Join:
        """Register a join of `a` (under the lock), in place of the failed join `replacing`
        when it tries again, and run it on its own thread."""
        join = Join(a, config, device, pause, deadline)
        if replacing is None:
            self._held.start_joining(join)
        else:
            self._held.retry(replacing, join)
        shutdown.start_thread(self._run, f"mw-join-{a.name}-{a.epoch}", join)
        return join

    def _run(self, join: Join) -> None:
        from multiworld.world.core import form_world

        join.cancelled.wait(join.pause)  # a join called off meanwhile ends at once in form_world
        config = join.config or self.config
        if join.deadline is None:
            join.deadline = time.monotonic() + config.join_timeout
        try:
            world = form_world(
                join.assignment,
                pod=self._pod,
                config=config,
                device=join.device if join.device is not None else self._device,
                detector=self._detector,
                cancelled=join.cancelled,
                on_broken=self._reporter.world_broken,
                deadline=join.deadline,
            )
        except BaseException as exc:
            self._failed(join, exc)
        else:
            self._install(join, world)

    def _install(self, join: Join, world: World) -> None:
        held = self._held
        name = join.assignment.name
        current = held.install(join, world)
        if current:
            metrics.world_joined(name)
        else:
            world.close("cancelled its join")
            join.error = JoinCancelled(name)
            self.unserve_if_unused(join.assignment)
        join.done.set()
        self._reporter.changed()

    def _failed(self, join: Join, exc: BaseException) -> None:
        held = self._held
        a = join.assignment
        join.error = exc
        with held.lock:
            current = held.joining(a.name) is join
            # Following a live table, a join that timed out goes on waiting (a peer's pod may be
            # scheduling or pulling its image), reported: the platform decides whether the
            # epoch failed. One that lost its store tries again within the same deadline,
            # unreported: the address may have led to a replaced instance for a moment (its
            # pod's new instance may already run, so the platform could not tell this from a
            # failure), and a store that keeps failing ends in a timeout. A newer epoch calls
            # this join off.
            again = current and isinstance(exc, (JoinTimedOut, StoreLost)) and self._follows_table and not held.closed
            retried_quietly = again and isinstance(exc, StoreLost)
            if again:
                pause, deadline = (RETRY_PAUSE_S, join.deadline) if retried_quietly else (0.0, None)
                self._launch(a, join.config, join.device, pause, replacing=join, deadline=deadline)
            elif current:
                held.give_up(join)
        if retried_quietly:
            WorldLog(log, a.name, a.epoch).info("lost its store while joining; trying again: %s", exc)
        elif current and not isinstance(exc, (JoinCancelled, StaleEpochError)):
            WorldLog(log, a.name, a.epoch).warning("could not join: %s", exc)
            self._reporter.join_failed(a, exc)
        elif current:
            WorldLog(log, a.name, a.epoch).info("gave up joining: %s", exc)
        self.unserve_if_unused(a)
        join.done.set()
        self._reporter.changed()


def _refuse_older(a: WorldAssignment, current: WorldAssignment, state: str) -> None:
    if current.epoch > a.epoch:
        raise StaleEpochError(f"world {a.name!r}: epoch {a.epoch} is older than epoch {current.epoch}, {state}")
    if current.epoch == a.epoch:
        raise WorldJoinError(
            f"world {a.name!r} epoch {a.epoch} is already {state} as rank {current.rank} of {current.size} "
            f"at {current.host}:{current.port}; a changed world needs a new epoch"
        )
