"""What one WorldManager holds, shared by its parts: the worlds joined, the joins in flight, a
spare's identity, and the one re-entrant lock that guards all of it.

The manager's parts (joining.py, table_following.py, waiting.py, worker_status.py, and
manager.py itself) share these fields, and no other state: each reads and changes them under
`lock`. No torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multiworld.joining import Join
    from multiworld.world import World


class Holdings:
    """The state one WorldManager's parts share (see the module's docstring)."""

    def __init__(self, *, spare: bool) -> None:
        self.lock = threading.RLock()
        # The worlds held, by name: the latest incarnation of each (a broken one until a newer
        # epoch is joined), and when each was joined.
        self.worlds: dict[str, World] = {}
        self.joined_at: dict[str, datetime] = {}
        # The joins in flight, by world name (one per world: a newer epoch calls the older off).
        self.joins: dict[str, Join] = {}
        # The epoch per world whose join failed: not retried.
        self.given_up: dict[str, int] = {}
        self.closed = False
        # A warm spare waits for an identity until a live table names its pod; then it plays
        # that member pod (empty: it plays its own).
        self.waiting = spare
        self.plays = ""
        # Called once at the next change, outside the lock; what they return is ignored.
        self._watchers: list[Callable[[], object]] = []

    def names(self) -> set[str]:
        """The worlds held or being joined."""
        return set(self.worlds) | set(self.joins)

    def known(self) -> str:
        """What this process holds, for an UnknownWorldError."""
        held = sorted(self.names())
        return f"this process holds {', '.join(repr(n) for n in held)}" if held else "this process holds no world"

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this WorldManager is closed")

    def watch(self, wake: Callable[[], object]) -> None:
        """Call `wake` once, at the next change (under the lock)."""
        self._watchers.append(wake)

    def take_watchers(self) -> list[Callable[[], object]]:
        """The watchers to wake for a change that happened (under the lock); they are called
        outside it, and each only once."""
        watchers, self._watchers = self._watchers, []
        return watchers
