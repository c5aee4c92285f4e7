"""The planner's memory on Kubernetes (pure): the whole MultiWorldStatus as gzipped JSON in the
ConfigMap named like the MultiWorld, written before the table and the pods it speaks of.

The CR's status carries only the view (what kubectl shows). The rest (each world's formation
and restart history, the record of every pod instance asked for, the table's revision) is what
the planner needs to plan again after the operator restarts, and nobody else reads it; kept out
of the MultiWorld, it costs the clients that watch MultiWorlds nothing. Gzipped, because it
repeats pod and world names: thousands of worlds stay far below the 1 MiB object limit.
"""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Mapping
from typing import Any

from multiworld.contract import NAME_LABEL

from .bodies import owner_reference

MEMORY_KEY = "status.json.gz"


def memory_body(multiworld: Mapping[str, Any], memory: Mapping[str, Any]) -> dict[str, Any]:
    name = multiworld["metadata"]["name"]
    raw = json.dumps(memory, separators=(",", ":")).encode()
    # mtime 0: the same memory always makes the same bytes.
    packed = gzip.compress(raw, compresslevel=1, mtime=0)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": {NAME_LABEL: name}, "ownerReferences": [owner_reference(multiworld)]},
        "binaryData": {MEMORY_KEY: base64.b64encode(packed).decode()},
    }


def read_memory(configmap: Mapping[str, Any]) -> dict[str, Any] | None:
    """The memory a ConfigMap holds; None when it holds none."""
    packed = (configmap.get("binaryData") or {}).get(MEMORY_KEY)
    if packed is None:
        return None
    memory: dict[str, Any] = json.loads(gzip.decompress(base64.b64decode(packed)))
    return memory
