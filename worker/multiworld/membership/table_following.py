"""Following the live world table: join the worlds and newer epochs it gives this pod, leave
the worlds it no longer names, give a waiting spare its identity, and stop following once a
newer instance of the pod took its ranks. No torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from multiworld.contract import WorldAssignment, WorldTable
from multiworld.errors import WorldJoinError
from multiworld.log_context import WorldLog
from multiworld.membership.holdings import Holdings
from multiworld.membership.joining import Joiner
from multiworld.membership.worker_status import StatusReporter

log = logging.getLogger(__name__)


class TableFollower:
    """Applies each revision of the table to one manager. `instance`: the epochs (world ->
    epoch) this process's pod was created for; a table that names a newer instance of the pod
    is not followed. `leave(name)`: the manager's leave of a world or of its join, under the
    holdings' lock."""

    def __init__(
        self,
        held: Holdings,
        joiner: Joiner,
        reporter: StatusReporter,
        *,
        pod: str,
        instance: Mapping[str, int] | None,
        leave: Callable[[str], None],
    ) -> None:
        self._held = held
        self._joiner = joiner
        self._reporter = reporter
        self._pod = pod
        self._instance = dict(instance or {})
        self._leave = leave
        self._revision = -1
        self._replaced = False

    def apply(self, table: WorldTable | Mapping[str, Any]) -> None:
        """Match the table: join new worlds and newer epochs (in the background), leave worlds
        that are gone. Older revisions are ignored. Never blocks."""
        table = table if isinstance(table, WorldTable) else WorldTable.model_validate(table)
        if table.revision == 0 and not table.worlds:
            # The default table: a platform that has published nothing yet, not "no worlds".
            return
        held = self._held
        with held.lock:
            if held.closed:
                return
            if table.revision < self._revision:
                log.debug("ignoring world table revision %d (have %d)", table.revision, self._revision)
                return
            self._revision = table.revision
            if self._replaced or self._superseded(table):
                return
            mine = table.assignments_for(self._pod)
            identified = held.waiting and bool(mine)
            if identified:
                held.identify(table.plays(self._pod))
                log.info("spare pod %s plays %s from world table revision %d", self._pod, held.plays, table.revision)
            for name in held.names() - set(mine):
                self._leave(name)
            for a in mine.values():
                if self._wants(a):
                    try:
                        self._joiner.start(a)
                    except WorldJoinError as exc:
                        log.warning("world table revision %d: %s", table.revision, exc)
        # Tells the platform that this process is joining the new epochs (it is alive and
        # follows the table), and a spare's identity.
        self._reporter.changed()

    def _superseded(self, table: WorldTable) -> bool:
        """Whether the table gives this pod's ranks to a newer instance of it; then leave every
        world for good (the platform is stopping this process)."""
        worlds = table.replaced(self._pod, self._instance)
        if not worlds:
            return False
        log.warning(
            "pod %s was replaced by a newer instance (worlds %s): this process joins nothing more",
            self._pod,
            ", ".join(worlds),
        )
        self._replaced = True
        for name in self._held.names():
            self._leave(name)
        return True

    def _wants(self, a: WorldAssignment) -> bool:
        held = self._held
        current = held.latest(a.name)
        if current is not None and current.epoch >= a.epoch:
            if current.epoch == a.epoch and current != a:
                WorldLog(log, a.name, a.epoch).error("changed without a new epoch; ignored")
            return False
        return held.given_up_epoch(a.name) < a.epoch
