"""The live world table of one MultiWorld as published: one ConfigMap per world (world_tables.py
holds the bodies), rewritten where its entry changed, deleted when its world left the table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multiworld.contract import WORLD_LABEL, WorldEntry, WorldTable, world_table_name

from .api import KubeApi, gather_bounded
from .bodies import selector
from .configmap_writer import ConfigMapWriter
from .observe import ObjectMeta
from .world_tables import published_entry, table_writes, world_table_body


class TablePublisher:
    def __init__(self, api: KubeApi, namespace: str, name: str, uid: str, configmaps: ConfigMapWriter) -> None:
        self.api = api
        self.namespace, self.name, self.uid = namespace, name, uid
        self.configmaps = configmaps
        # World -> the entry its ConfigMap holds now (None: there, but unreadable).
        self.published: dict[str, WorldEntry | None] = {}

    async def load(self) -> None:
        """The entries as published (by this operator before it restarted, say)."""
        for item in await self.api.list_configmaps(self.namespace, f"{selector(self.name)},{WORLD_LABEL}"):
            meta = ObjectMeta.model_validate(item["metadata"])
            if meta.owned_by(self.uid) and WORLD_LABEL in meta.labels:
                self.published[meta.labels[WORLD_LABEL]] = published_entry(item)
                self.configmaps.read_at(meta.name, meta.resource_version)

    async def publish(self, body: Mapping[str, Any], table: WorldTable) -> list[str]:
        """Make the world ConfigMaps hold the table's entries; why some could not, if they could not."""
        writes = table_writes(self.published, table)

        async def write(entry: WorldEntry) -> str | None:
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

        failures = await gather_bounded(write(entry) for entry in writes.write)
        await gather_bounded(remove(world) for world in writes.remove)
        return [f for f in failures if f]
