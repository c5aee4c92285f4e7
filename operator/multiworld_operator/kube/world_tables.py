"""The live world table on Kubernetes (pure): one ConfigMap per world (multiworld.contract
names them), and the writes that turn the published entries into the planner's table.

Per world, not one object for all: a world's failure rewrites that world's ConfigMap only, and
each worker watches the ConfigMaps labelled with its own pod, so it receives its own worlds'
entries and nothing of anyone else's. The operator watches them (NAME_LABEL and WORLD_LABEL: the
memory has neither), to write again one deleted or edited.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from multiworld.contract import (
    NAME_LABEL,
    POD_LABEL_PREFIX,
    TABLE_ENTRY_KEY,
    WORLD_LABEL,
    WorldEntry,
    WorldTable,
    table_entry,
    world_table_name,
)

from .bodies import owner_reference


def world_table_body(multiworld: Mapping[str, Any], entry: WorldEntry) -> dict[str, Any]:
    name = multiworld["metadata"]["name"]
    labels = {NAME_LABEL: name, WORLD_LABEL: entry.name}
    labels.update({f"{POD_LABEL_PREFIX}{pod}": str(rank) for rank, pod in enumerate(entry.pods)})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": world_table_name(name, entry.name),
            "labels": labels,
            "ownerReferences": [owner_reference(multiworld)],
        },
        "data": {TABLE_ENTRY_KEY: entry.model_dump_json()},
    }


def published_entry(configmap: Mapping[str, Any]) -> WorldEntry | None:
    """The entry a world ConfigMap holds; None when it holds none that parses (rewritten then)."""
    try:
        return table_entry(configmap)
    except ValueError:
        return None


@dataclass(frozen=True)
class TableWrites:
    """What makes the published entries match a table: entries to write (create or replace)
    and worlds whose ConfigMap goes (the world left the table)."""

    write: list[WorldEntry] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)


def table_writes(published: Mapping[str, WorldEntry | None], table: WorldTable) -> TableWrites:
    wanted = {entry.name: entry for entry in table.worlds}
    return TableWrites(
        write=[entry for name, entry in wanted.items() if published.get(name) != entry],
        remove=sorted(set(published) - set(wanted)),
    )
