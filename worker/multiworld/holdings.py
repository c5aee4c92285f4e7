"""What one WorldManager holds, shared by its parts: the worlds joined, the joins in flight
(`Join`: one rendezvous, run by joining.py), a spare's identity, and the one re-entrant lock
that guards all of it.

The manager's parts (joining.py, table_following.py, waiting.py, worker_status.py, and
manager.py itself) share these fields, and no other state: each reads and changes them under
`lock`. No torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from multiworld.contract import WorldAssignment

if TYPE_CHECKING:
    import torch

    from multiworld.detect_config import DetectConfig
    from multiworld.world import World


class Join:
    """One rendezvous in flight on its own daemon thread. `config` and `device`: this join's
    own, where they differ from the manager's (None: the manager's); `pause`: seconds it waits
    before it starts (a try again). `done` is set once it ended, with `world` or `error` set."""

    def __init__(
        self,
        assignment: WorldAssignment,
        config: DetectConfig | None = None,
        device: str | torch.device | None = None,
        pause: float = 0.0,
    ) -> None:
        self.assignment = assignment
        self.config = config
        self.device = device
        self.pause = pause
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.world: World | None = None
        self.error: BaseException | None = None

    @classmethod
    def holding(cls, world: World) -> Join:
        """A finished join of a world already held."""
        join = cls(world.assignment)
        join.world = world
        join.done.set()
        return join

    def result(self) -> World:
        if self.error is not None:
            raise self.error
        assert self.world is not None
        return self.world


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
