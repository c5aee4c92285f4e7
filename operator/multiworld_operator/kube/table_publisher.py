"""The live world table of one MultiWorld as published: one ConfigMap per world (world_tables.py
holds the bodies), rewritten where its entry changed, deleted when its world left the table.

Repaired, not left to chance: the ConfigMaps are watched (handlers.py), and one deleted, or
written by someone else, is forgotten as published, so the next step writes it again (at the
version the watch showed)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

from multiworld.contract import WORLD_LABEL, WorldEntry, WorldTable, world_table_name

from .api import KubeApi, gather_bounded
from .bodies import selector
from .configmap_writer import ConfigMapWriter
from .observe import ObjectMeta
from .world_tables import published_entry, table_writes, world_table_body

log = logging.getLogger(__name__)

# Our own last writes per world, told apart from someone else's when the watch reports them.
KEPT_WRITES = 3


class TablePublisher:
    def __init__(self, api: KubeApi, namespace: str, name: str, uid: str, configmaps: ConfigMapWriter) -> None:
        self.api = api
        self.namespace, self.name, self.uid = namespace, name, uid
        self.configmaps = configmaps
        # World -> the entry its ConfigMap holds now (None: there, but unreadable, or to be
        # written again).
        self.published: dict[str, WorldEntry | None] = {}
        # World -> the entries this operator last wrote (or read) there.
        self._ours: dict[str, deque[WorldEntry]] = {}

    async def load(self) -> None:
        """The entries as published (by this operator before it restarted, say)."""
        for item in await self.api.list_configmaps(self.namespace, f"{selector(self.name)},{WORLD_LABEL}"):
            meta = ObjectMeta.model_validate(item["metadata"])
            if meta.owned_by(self.uid) and WORLD_LABEL in meta.labels:
                world = meta.labels[WORLD_LABEL]
                entry = published_entry(item)
                self.published[world] = entry
                self._remember(world, entry)
                self.configmaps.read_at(meta.name, meta.resource_version)

    def _remember(self, world: str, entry: WorldEntry | None) -> None:
        if entry is not None:
            self._ours.setdefault(world, deque(maxlen=KEPT_WRITES)).append(entry)

    async def publish(self, body: Mapping[str, Any], table: WorldTable) -> list[str]:
        """Make the world ConfigMaps hold the table's entries; why some could not, if they could not."""
        writes = table_writes(self.published, table)

        async def write(entry: WorldEntry) -> str | None:
            self._remember(entry.name, entry)
            if not await self.configmaps.write(world_table_body(body, entry)):
                return (
                    f"ConfigMap {world_table_name(self.name, entry.name)} (world {entry.name}'s table entry) "
                    "already exists and is not this MultiWorld's; it is left alone"
                )
            self.published[entry.name] = entry
            return None

        async def remove(world: str) -> None:
            await self.configmaps.delete(world_table_name(self.name, world))
            del self.published[world]
            self._ours.pop(world, None)

        failures = await gather_bounded(write(entry) for entry in writes.write)
        await gather_bounded(remove(world) for world in writes.remove)
        return [f for f in failures if f]

    def changed(self, deleted: bool, configmap: Mapping[str, Any]) -> bool:
        """A world ConfigMap as the watch reported it; True when it no longer holds what this
        operator published (deleted, or written by someone else): the next step writes it again."""
        meta = ObjectMeta.model_validate(configmap["metadata"])
        world = meta.labels.get(WORLD_LABEL)
        if world is None or world not in self.published or not meta.owned_by(self.uid):
            return False
        if deleted:
            what = "was deleted"
        else:
            entry = published_entry(configmap)
            if entry is not None and entry in self._ours.get(world, ()):
                return False  # our own write (or read) coming back
            what = "was written by someone else"
            self.configmaps.read_at(meta.name, meta.resource_version)
        log.warning(
            "%s/%s: ConfigMap %s (world %s's table entry) %s: writing it again",
            self.namespace,
            self.name,
            meta.name,
            world,
            what,
        )
        self.published[world] = None
        return True
