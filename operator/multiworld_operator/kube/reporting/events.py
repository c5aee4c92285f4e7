"""The Events posted on one MultiWorld: best effort (a lost one must not stop the reconcile),
a refusal that recurs at every retried step posted once, and at most so many in all (a
workload that fails again and again must not fill etcd with Events): past the budget they are
counted, and the next one the budget allows is preceded by one that says what was held back."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from kubernetes.client.rest import ApiException

from multiworld.per_source import Budgets
from multiworld_operator.kube.client.api import KubeApi
from multiworld_operator.kube.client.api_basics import api_message
from multiworld_operator.log_context import about

log = logging.getLogger(__name__)

# Events one MultiWorld may post: a burst, then one every EVENT_REFILL_S (client-go's recorder
# allows an object 25 at once, then one per 5 minutes; a failure here is news sooner). The burst
# grows with the worlds, by what one world says when it first forms and once per failure
# (WorldReady; WorldFailed, WorldRestarting, WorldRecovered), so that a large MultiWorld's start
# does not spend what its first failures have to say. The spec caps the worlds (MAX_WORLDS).
EVENT_BURST = 50
EVENTS_PER_WORLD = 4
EVENT_REFILL_S = 30.0
SUPPRESSED = "EventsSuppressed"


class MultiWorldEvents:
    def __init__(self, api: KubeApi, multiworld: dict[str, Any]) -> None:
        self.api = api
        self.multiworld = multiworld  # its metadata names the object the Events are about
        # Warnings posted once, so a retried step does not repeat them.
        self._posted_once: set[str] = set()
        self._budget = Budgets(EVENT_BURST, 1 / EVENT_REFILL_S)
        # Events held back since the last one posted, by reason, and since when.
        self._held: Counter[str] = Counter()
        self._held_since = 0.0

    async def post(
        self, type_: str, reason: str, message: str, world: str | None = None, epoch: int | None = None
    ) -> None:
        """Post an Event (`world` and `epoch`: what it is about, for the log) unless the budget is spent."""
        if not self._budget.take(()):
            if not self._held:
                self._held_since = time.monotonic()
            self._held[reason] += 1
            return
        if self._held:
            held = ", ".join(f"{count} {reason}" for reason, count in self._held.most_common())
            self._held.clear()
            await self._post(
                "Warning",
                SUPPRESSED,
                f"{held} not posted in the last {time.monotonic() - self._held_since:.0f} s: this MultiWorld "
                f"posts {self._budget.burst:.0f} Events at once, then one every {EVENT_REFILL_S:.0f} s",
            )
        await self._post(type_, reason, message, world, epoch)

    def allow_for(self, worlds: int) -> None:
        """Size the burst for a MultiWorld of `worlds` worlds (its spec as last parsed)."""
        self._budget.burst = EVENT_BURST + EVENTS_PER_WORLD * worlds

    async def _post(
        self, type_: str, reason: str, message: str, world: str | None = None, epoch: int | None = None
    ) -> None:
        try:
            await self.api.post_event(self.multiworld, type_, reason, message)
        except ApiException as error:
            log.warning("event %s not posted: %s", reason, api_message(error), extra=about(world, epoch))
        else:
            log.info("%s %s: %s", type_, reason, message, extra=about(world, epoch))

    async def warn_once(self, reason: str, messages: list[str]) -> None:
        """A Warning per message not posted before."""
        new = [m for m in messages if m not in self._posted_once]
        for message in new:
            await self.post("Warning", reason, message)
            self._posted_once.add(message)
