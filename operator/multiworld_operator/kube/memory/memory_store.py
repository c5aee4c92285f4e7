"""The planner's memory of one MultiWorld, kept in its ConfigMap `<mw>` (planner_memory.py holds
the body): read once, written whenever the planner's status changed, before the table and the
pods it speaks of.

Repaired, not reset: a memory deleted while the operator runs is written again by the next step
that changes it (it is not watched: each write would come back whole, up to 1 MiB, to the
operator; one written by someone else is read again through the 409 its next write meets). A
memory found lost or corrupt when it is read (after an operator restart, or a 409) is rebuilt
from what the cluster still shows (planner_memory.rebuilt_memory: the pods and their
created-for stamps, the CR's status), no running pod deleted, and the rebuild
is announced by a Warning Event (MemoryRebuilt).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from kubernetes.client.rest import ApiException

from multiworld_operator.kube.client.api import KubeApi
from multiworld_operator.kube.client.api_basics import api_message
from multiworld_operator.kube.memory.configmap_writer import ConfigMapWriter
from multiworld_operator.kube.memory.planner_memory import (
    CorruptMemory,
    loaded_status,
    memory_body,
    read_memory,
    rebuilt_memory,
)
from multiworld_operator.kube.objects.bodies import MEMORY_LABEL, selector
from multiworld_operator.kube.objects.observe import ObjectMeta, see_pod
from multiworld_operator.planner import MultiWorldStatus
from multiworld_operator.spec import MultiWorld
from multiworld_operator.spec.resource import GROUP_VERSION, KIND

log = logging.getLogger(__name__)

MEMORY_REBUILT = "MemoryRebuilt"


class PlannerMemoryStore:
    def __init__(self, api: KubeApi, namespace: str, name: str, uid: str, configmaps: ConfigMapWriter) -> None:
        self.api = api
        self.namespace, self.name, self.uid = namespace, name, uid
        self.configmaps = configmaps
        # The memory as stored, and as the planner reads it (None: not read yet, or there is
        # none: see load; `stored` None with `remembered` set: to be written again).
        self.stored: dict[str, Any] | None = None
        self.remembered: MultiWorldStatus | None = None
        self.loaded = False

    async def load(self, view: Mapping[str, Any] | None, multiworld: MultiWorld) -> None:
        """The memory: its ConfigMap; else `view` (the CR's status), where an operator before
        the ConfigMap wrote it there whole, with the table; else, when the view shows worlds
        (the memory was lost, or cannot be read), the memory rebuilt from the cluster; else
        none (a new MultiWorld)."""
        found = await self.api.read_configmap(self.namespace, self.name)
        lost: str | None = None
        if found is not None and ObjectMeta.model_validate(found["metadata"]).owned_by(self.uid):
            meta = ObjectMeta.model_validate(found["metadata"])
            self.configmaps.read_at(self.name, meta.resource_version)
            try:
                # Off the event loop: the largest accepted spec's memory takes most of a second.
                stored, remembered = await asyncio.to_thread(_read, found)
            except CorruptMemory as error:
                lost = f"cannot be read ({error})"
            else:
                if remembered is not None or not (view and view.get("worlds")):
                    if MEMORY_LABEL in meta.labels:  # else: relabelled by the next write
                        self.stored = stored
                    self.remembered, self.loaded = remembered, True
                    return
                lost = "holds no memory"
        elif view is not None and "table" in view:
            self.stored = dict(view)
            self.remembered, self.loaded = MultiWorldStatus.from_dict(self.stored), True
            return
        elif view is not None and view.get("worlds"):
            lost = "is gone"
        if lost is not None:
            await self._rebuild(
                view, multiworld, f"ConfigMap {self.name} (the operator's memory of this MultiWorld) {lost}"
            )
        self.loaded = True

    async def _rebuild(self, view: Mapping[str, Any] | None, multiworld: MultiWorld, why: str) -> None:
        """The memory rebuilt from the pods, `view` and the spec; announced."""
        items, _ = await self.api.list_pods(self.namespace, selector(self.name))
        pods = [see_pod(item, self.uid) for item in items]
        self.stored = None
        self.remembered = rebuilt_memory(view, pods, multiworld)
        if self.remembered is None:
            message = f"{why}: every world starts afresh"
        else:
            message = (
                f"{why}: rebuilt from {len(self.remembered.pods)} pod(s), their created-for stamps, the "
                "status and the spec; each world keeps its epoch and restart count, its restart budget counts "
                "from its last failure"
            )
        log.warning("%s", message)
        involved = {
            "apiVersion": GROUP_VERSION,
            "kind": KIND,
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid},
        }
        try:
            await self.api.post_event(involved, "Warning", MEMORY_REBUILT, message)
        except ApiException as error:  # best effort, as every Event
            log.warning("event %s not posted: %s", MEMORY_REBUILT, api_message(error))

    async def remember(self, body: Mapping[str, Any], status: MultiWorldStatus) -> str | None:
        """Store the planner's memory; why it could not be, if it could not."""
        memory = status.to_dict()  # compared as dicts: far cheaper than comparing the models
        if memory != self.stored:
            if not await self.configmaps.write(memory_body(body, memory)):
                return (
                    f"ConfigMap {self.name} (the operator's memory of this MultiWorld) already exists and is "
                    "not this MultiWorld's; it is left alone"
                )
        self.stored, self.remembered = memory, status
        return None


def _read(configmap: Mapping[str, Any]) -> tuple[dict[str, Any] | None, MultiWorldStatus | None]:
    """The memory a ConfigMap holds, as stored and as the planner reads it; CorruptMemory."""
    stored = read_memory(configmap)
    return stored, loaded_status(stored)
