"""The Events posted on one MultiWorld: best effort (a lost one must not stop the reconcile),
and a refusal that recurs at every retried step posted once."""

from __future__ import annotations

import logging
from typing import Any

from kubernetes.client.rest import ApiException

from multiworld_operator.kube.api_basics import api_message

from .api import KubeApi

log = logging.getLogger(__name__)


class MultiWorldEvents:
    def __init__(self, api: KubeApi, multiworld: dict[str, Any]) -> None:
        self.api = api
        self.multiworld = multiworld  # its metadata names the object the Events are about
        # Warnings posted once, so a retried step does not repeat them.
        self._posted_once: set[str] = set()

    async def post(self, type_: str, reason: str, message: str) -> None:
        try:
            await self.api.post_event(self.multiworld, type_, reason, message)
        except ApiException as error:
            meta = self.multiworld["metadata"]
            log.warning("%s/%s: event %s not posted: %s", meta["namespace"], meta["name"], reason, api_message(error))

    async def warn_once(self, reason: str, messages: list[str]) -> None:
        """A Warning per message not posted before."""
        new = [m for m in messages if m not in self._posted_once]
        for message in new:
            await self.post("Warning", reason, message)
            self._posted_once.add(message)
