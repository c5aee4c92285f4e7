"""pymultiworld's world names as this library's: pymultiworld takes any string ("" by default),
while a world's name here is a DNS label (it prefixes store keys and is the contract's). Both
faces of pymultiworld's API (compat.py's manager methods, communicator.py's ops) name worlds
through `world_label`."""

from __future__ import annotations

import hashlib
import re

from multiworld.contract import WORLD_NAME_RE

DEFAULT_WORLD_NAME = ""

# A mapped name: up to 40 readable characters, "-", 16 hex digits of the name's hash (57 <= 63).
_READABLE = 40
_DIGEST = 16


def world_label(world_name: str) -> str:
    """The library's name for a pymultiworld world name. A DNS label stays itself; any other
    name becomes its readable part and a hash of the whole name, the same in every process
    (two different names meet only if one is chosen to be the other's hashed form)."""
    if not isinstance(world_name, str):
        raise TypeError(f"world_name must be a str, got {world_name!r}")
    if len(world_name) <= 63 and WORLD_NAME_RE.match(world_name):
        return world_name
    readable = re.sub(r"[^a-z0-9]+", "-", world_name.lower()).strip("-")[:_READABLE].strip("-")
    digest = hashlib.sha256(world_name.encode()).hexdigest()[:_DIGEST]
    return f"{readable or 'world'}-{digest}"
