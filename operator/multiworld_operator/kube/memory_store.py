"""The planner's memory of one MultiWorld, kept in its ConfigMap `<mw>` (planner_memory.py holds
the body): read once, written whenever the planner's status changed, before the table and the
pods it speaks of."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..planner import MultiWorldStatus
from .api import KubeApi
from .configmap_writer import ConfigMapWriter
from .observe import ObjectMeta
from .planner_memory import memory_body, read_memory

log = logging.getLogger(__name__)


class PlannerMemoryStore:
    def __init__(self, api: KubeApi, namespace: str, name: str, uid: str, configmaps: ConfigMapWriter) -> None:
        self.api = api
        self.namespace, self.name, self.uid = namespace, name, uid
        self.configmaps = configmaps
        # The memory as stored, and as the planner reads it (None: not read yet, or there is
        # none: see load).
        self.stored: dict[str, Any] | None = None
        self.remembered: MultiWorldStatus | None = None

    async def load(self, view: Mapping[str, Any] | None) -> None:
        """The memory: its ConfigMap; else `view` (the CR's status), where an operator before
        the ConfigMap wrote it there whole, with the table; else none (a new MultiWorld)."""
        found = await self.api.read_configmap(self.namespace, self.name)
        if found is not None and ObjectMeta.model_validate(found["metadata"]).owned_by(self.uid):
            self.stored = read_memory(found)
            self.configmaps.read_at(self.name, str(found["metadata"]["resourceVersion"]))
        elif view is not None and "table" in view:
            self.stored = dict(view)
        elif view is not None and view.get("worlds"):
            log.warning(
                "%s/%s: the operator's memory (ConfigMap %s) is gone: every world starts afresh",
                self.namespace,
                self.name,
                self.name,
            )
        self.remembered = MultiWorldStatus.from_dict(self.stored)

    async def remember(self, body: Mapping[str, Any], status: MultiWorldStatus) -> str | None:
        """Store the planner's memory; why it could not be, if it could not."""
        memory = status.to_dict()  # compared as dicts: far cheaper than comparing the models
        if memory != self.stored and not await self.configmaps.write(memory_body(body, memory)):
            return (
                f"ConfigMap {self.name} (the operator's memory of this MultiWorld) already exists and is "
                "not this MultiWorld's; it is left alone"
            )
        self.stored, self.remembered = memory, status
        return None
