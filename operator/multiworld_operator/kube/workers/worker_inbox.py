"""What one MultiWorld's workers told the operator over the worker channel (pure): each pod
instance's latest WorkerStatus, and the reports accepted.

A report counts only when its pod (authenticated: worker_identity.py) holds a rank in the world
it names at that world's current epoch in the table the operator published. A report for a world
the pod is not in, or for an epoch the world has not reached, is refused and said on the
MultiWorld (a Warning Event naming the pod, once per pod and world); one for an epoch already
past is a report that crossed the new table in flight, dropped quietly. Accepted reports last
only as long as the epoch they name.

What is kept is bounded by the table, not by what workers send (each message may be up to the
channel's MAX_LINE): a status keeps only what it says of the worlds its pod holds a rank in
(once the table is known: at every step), a report's reason its first MAX_REASON characters,
so that all a MultiWorld's workers hold in the operator grows with its ranks.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Mapping, Set

from multiworld.contract import BrokenWorldReport, WorkerStatus, WorldEntry, WorldTable
from multiworld_operator.log_context import about
from multiworld_operator.spec.names import MAX_LABEL

log = logging.getLogger(__name__)

# The Warning Event that says a report was refused.
REPORT_REFUSED = "ReportRefused"
# Refusals remembered (to say each once); forgotten all at once beyond this.
MAX_WARNED = 1024
# A report's reason as kept (the failure it causes quotes less of it: MAX_FAILURE_MESSAGE).
MAX_REASON = 1024


class WorkerInbox:
    def __init__(self) -> None:
        # Pod uid -> its worker's latest status.
        self.statuses: dict[str, WorkerStatus] = {}
        # (world, pod) -> the latest report accepted.
        self._reports: dict[tuple[str, str], BrokenWorldReport] = {}
        # Reports that came before the operator knew the table (it had just started), the latest
        # per pod and world (so bounded like the accepted ones): checked with the first table.
        self._unchecked: dict[tuple[str, str], BrokenWorldReport] = {}
        self._warned: set[tuple[str, str]] = set()
        self._refusals: list[str] = []

    def status(self, uid: str, status: WorkerStatus, table: WorldTable | None) -> bool:
        """Take a worker's status (of pod `status.pod`), what it says of the worlds `table`
        gives that pod only, when the table is known; whether it is news."""
        if table is not None:
            status = _within(status, {w.name for w in table.worlds if status.pod in w.pods})
        if self.statuses.get(uid) == status:
            return False
        self.statuses[uid] = status
        return True

    def report(self, pod: str, report: BrokenWorldReport, table: WorldTable | None) -> bool:
        """Take a report from `pod`; whether it was accepted (news for the planner)."""
        report = report.model_copy(update={"reason": report.reason[:MAX_REASON], "plays": report.plays[:MAX_LABEL]})
        if table is None:
            self._unchecked[(pod, report.world)] = report
            return True
        entry = next((w for w in table.worlds if w.name == report.world), None)
        if entry is None or pod not in entry.pods:
            self._refuse(pod, report, f"a world it holds no rank in (its {report.epoch})")
            return False
        if report.epoch > entry.epoch:
            self._refuse(
                pod, report, f"epoch {report.epoch}, which that world has not reached (it is at {entry.epoch})"
            )
            return False
        if report.epoch < entry.epoch:
            log.debug("pod %s: report came after epoch %d", pod, entry.epoch, extra=about(report.world, report.epoch))
            return False
        self._reports[(report.world, pod)] = report
        return True

    def _refuse(self, pod: str, report: BrokenWorldReport, what: str) -> None:
        log.warning("pod %s reported its world broken at %s: ignored", pod, what, extra=about(report.world))
        if (pod, report.world) in self._warned:
            return
        if len(self._warned) >= MAX_WARNED:
            self._warned.clear()
        self._warned.add((pod, report.world))
        self._refusals.append(
            f"pod {pod} reported world {report.world} broken at {what}: ignored (a worker speaks only for "
            "the worlds its pod holds a rank in, at their current epoch)"
        )

    def take_refusals(self) -> list[str]:
        """The refusals not said yet (each becomes a Warning Event)."""
        refusals, self._refusals = self._refusals, []
        return refusals

    def current(
        self, table: WorldTable, uids: Collection[str], addresses: Mapping[str, str] | None = None
    ) -> tuple[dict[str, WorkerStatus], list[BrokenWorldReport]]:
        """The statuses of the pod instances `uids` (what each says of its pod's worlds in
        `table`) and the reports at their world's current epoch in `table`; what is older is
        forgotten. `addresses` (pod IP -> pod) name the culprit
        of a report that names none where its reason gives the address of exactly one other rank
        (a failed op's error: gloo says "Connection closed by peer [10.244.0.79]:18818"), so a
        peer's report replaces the dead pod at once rather than when its kubelet says it failed."""
        unchecked, self._unchecked = self._unchecked, {}
        for (pod, _), report in unchecked.items():
            self.report(pod, report, table)
        epochs = {w.name: w.epoch for w in table.worlds}
        self._reports = {key: r for key, r in self._reports.items() if epochs.get(r.world) == r.epoch}
        worlds: dict[str, set[str]] = {}  # pod -> its worlds in the table
        for world in table.worlds:
            for pod in world.pods:
                worlds.setdefault(pod, set()).add(world.name)
        self.statuses = {uid: _within(s, worlds.get(s.pod, set())) for uid, s in self.statuses.items() if uid in uids}
        entries, addresses = {w.name: w for w in table.worlds}, addresses or {}
        reports = [_named_by_address(r, pod, entries[r.world], addresses) for (_, pod), r in self._reports.items()]
        return dict(self.statuses), reports


def _within(status: WorkerStatus, worlds: Set[str]) -> WorkerStatus:
    """What `status` says of `worlds` (its pod's) only; itself when it says of no other."""
    said = (status.joined, status.joining, status.errors, status.joined_at)
    if all(w in worlds for part in said for w in part) and len(status.plays) <= MAX_LABEL:
        return status
    return status.model_copy(
        update={
            "joined": {w: e for w, e in status.joined.items() if w in worlds},
            "joining": {w: e for w, e in status.joining.items() if w in worlds},
            "errors": {w: n for w, n in status.errors.items() if w in worlds},
            "joined_at": {w: t for w, t in status.joined_at.items() if w in worlds},
            "plays": status.plays[:MAX_LABEL],
        }
    )


# A peer's address in a failed op's error ("[10.244.0.79]:18818", "[fd00::5]:18818").
_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def _named_by_address(
    report: BrokenWorldReport, reporter: str, entry: WorldEntry, addresses: Mapping[str, str]
) -> BrokenWorldReport:
    """The report, naming the rank whose address its reason gives when it names none."""
    if report.peer_rank is not None:
        return report
    ranks = {
        entry.pods.index(pod)
        for address in _ADDRESS.findall(report.reason)
        if (pod := addresses.get(address)) is not None and pod in entry.pods and pod != reporter
    }
    if len(ranks) != 1:
        return report
    return report.model_copy(update={"peer_rank": ranks.pop()})
