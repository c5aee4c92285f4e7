"""A rendezvous port for each world (pure).

Rank 0 of a world hosts its store on `<rank0 pod>.<mw>:<port>`. Ports must differ between
worlds whose rank 0 is the same pod, and a world should keep its port across spec edits and
epochs. So a world keeps the port the previous world table gave it while that stays free on its
rank-0 pod; a world without one takes the first free port from a spot derived from its
MultiWorld's namespace and name and its own name: pods of `hostNetwork` share their node's
ports, and many MultiWorlds name their worlds alike ("world1").
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

from multiworld.contract import WorldTable
from multiworld_operator.spec import MultiWorld
from multiworld_operator.spec.limits import PORT_BASE, PORT_SPAN


def preferred_port(multiworld: MultiWorld, world: str) -> int:
    key = f"{multiworld.metadata.namespace or ''}/{multiworld.metadata.name}/{world}"
    digest = hashlib.sha256(key.encode()).digest()
    return PORT_BASE + int.from_bytes(digest[:4], "big") % PORT_SPAN


def world_ports(multiworld: MultiWorld, previous: WorldTable | None) -> dict[str, int]:
    """World name -> port, collision-free among worlds sharing a rank-0 pod."""
    kept = {entry.name: entry.port for entry in previous.worlds} if previous else {}
    rank0 = {w.name: multiworld.world_pods(w.name)[0] for w in multiworld.spec.worlds}
    taken: dict[str, set[int]] = defaultdict(set)
    ports: dict[str, int] = {}
    for world, pod in rank0.items():
        port = kept.get(world)
        if port is not None and port not in taken[pod]:
            ports[world] = port
            taken[pod].add(port)
    for world, pod in rank0.items():
        if world in ports:
            continue
        offset = preferred_port(multiworld, world) - PORT_BASE
        while PORT_BASE + offset in taken[pod]:
            offset = (offset + 1) % PORT_SPAN
        ports[world] = PORT_BASE + offset
        taken[pod].add(ports[world])
    return ports
