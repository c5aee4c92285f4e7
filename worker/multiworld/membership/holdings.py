"""What one WorldManager holds, and its one owner: the worlds joined, the joins in flight
(`Join`: one rendezvous, run by joining.py), a spare's identity, and the one re-entrant lock
that guards all of it.

The manager's parts (joining.py, table_following.py, waiting.py, worker_status.py, and
manager.py itself) read these through `Holdings`' methods and change them only through its
transitions: `start_joining`, `install`, `retry`, `give_up`, `call_off`, `forget`, `close` and
`identify`. Each transition takes the lock itself (a part that decides from what it read holds
the lock across the read and the transition), refuses a change that would break a rule below,
and checks the rules again after each change; a broken rule raises `RuleBroken`, a bug in a
caller or here, never a fault of a world. The rules:

- one join in flight per world, filed under its world's name, neither finished nor called off;
- a world held is filed under its name; a world held while a join of it is in flight is an
  older epoch than the join's, and broken (the manager closed it when the newer epoch came);
- `joined_at` names exactly the worlds held;
- a closed manager holds no world and joins none;
- a spare that waits for its identity plays no pod yet.

And three that no transition can undo: a closed manager never opens again, an identified spare
never waits again, and the epoch given up per world only grows. tests/worker/test_holdings.py
drives random sequences of the transitions and checks all of them after each step.

Holdings never calls a world (closing and releasing one is its caller's: see manager.py and
joining.py); it reads only a world's `assignment` and `broken`. No torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from multiworld.contract import WorldAssignment

if TYPE_CHECKING:
    import torch

    from multiworld.detect.config import DetectConfig
    from multiworld.world.core import World


class RuleBroken(AssertionError):
    """A transition of `Holdings` would break, or found broken, one of its rules: a bug in the
    caller or in Holdings."""


class Join:
    """One rendezvous in flight on its own daemon thread. `config` and `device`: this join's
    own, where they differ from the manager's (None: the manager's); `pause`: seconds it waits
    before it starts (a try again); `deadline`: when it times out (monotonic; None: the join
    timeout after it starts). `done` is set once it ended, with `world` or `error` set."""

    def __init__(
        self,
        assignment: WorldAssignment,
        config: DetectConfig | None = None,
        device: str | torch.device | None = None,
        pause: float = 0.0,
        deadline: float | None = None,
    ) -> None:
        self.assignment = assignment
        self.config = config
        self.device = device
        self.pause = pause
        self.deadline = deadline
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
    """The state one WorldManager's parts share, and the transitions that change it (see the
    module's docstring)."""

    def __init__(self, *, spare: bool) -> None:
        self.lock = threading.RLock()
        # The worlds held, by name: the latest incarnation of each (a broken one until a newer
        # epoch is joined), and when each was joined.
        self._worlds: dict[str, World] = {}
        self._joined_at: dict[str, datetime] = {}
        # The joins in flight, by world name (one per world: a newer epoch calls the older off).
        self._joins: dict[str, Join] = {}
        # The epoch per world whose join failed: not retried.
        self._given_up: dict[str, int] = {}
        self._closed = False
        # A warm spare waits for an identity until a live table names its pod; then it plays
        # that member pod (empty: it plays its own).
        self._waiting = spare
        self._plays = ""
        # Called once at the next change, outside the lock; what they return is ignored.
        self._watchers: list[Callable[[], object]] = []

    # -- reading -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def waiting(self) -> bool:
        """Whether this is a spare still waiting for its identity."""
        return self._waiting

    @property
    def plays(self) -> str:
        """The member pod an identified spare plays (empty: its own)."""
        return self._plays

    def world(self, name: str) -> World | None:
        """The world held under `name` (broken ones included), if any."""
        with self.lock:
            return self._worlds.get(name)

    def joining(self, name: str) -> Join | None:
        """The join of world `name` in flight, if any."""
        with self.lock:
            return self._joins.get(name)

    def worlds(self) -> dict[str, World]:
        """The worlds held, by name (a copy)."""
        with self.lock:
            return dict(self._worlds)

    def joins(self) -> dict[str, Join]:
        """The joins in flight, by world name (a copy)."""
        with self.lock:
            return dict(self._joins)

    def joined_at(self, name: str) -> datetime:
        """When the world held under `name` was joined (KeyError: none is held)."""
        with self.lock:
            return self._joined_at[name]

    def latest(self, name: str) -> WorldAssignment | None:
        """The newest assignment of world `name` here: its join's in flight, else its world's."""
        with self.lock:
            join = self._joins.get(name)
            if join is not None:
                return join.assignment
            world = self._worlds.get(name)
            return world.assignment if world is not None else None

    def given_up_epoch(self, name: str) -> int:
        """The newest epoch of world `name` whose join failed for good (0: none)."""
        with self.lock:
            return self._given_up.get(name, 0)

    def names(self) -> set[str]:
        """The worlds held or being joined."""
        with self.lock:
            return set(self._worlds) | set(self._joins)

    def known(self) -> str:
        """What this process holds, for an UnknownWorldError."""
        held = sorted(self.names())
        return f"this process holds {', '.join(repr(n) for n in held)}" if held else "this process holds no world"

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this WorldManager is closed")

    # -- transitions -------------------------------------------------------------------------

    def start_joining(self, join: Join) -> None:
        """File a new join in flight. The caller called off any join of its world first, and
        closed a world held under its name (which must be of an older epoch)."""
        a = join.assignment
        with self.lock:
            if self._closed:
                raise RuleBroken(f"world {a.name!r} epoch {a.epoch}: a join started on a closed manager")
            self._refuse_filing(join)
            self._joins[a.name] = join
            self._check()

    def retry(self, failed: Join, again: Join) -> None:
        """A join in flight failed and tries again: `again`, a new join of the same assignment,
        takes its place."""
        a = failed.assignment
        with self.lock:
            self._refuse_unless_current(failed, "retried")
            if again.assignment != a:
                raise RuleBroken(f"world {a.name!r}: epoch {a.epoch} retried as {again.assignment!r}")
            del self._joins[a.name]
            self._refuse_filing(again)
            self._joins[a.name] = again
            self._check()

    def install(self, join: Join, world: World, now: datetime | None = None) -> bool:
        """The join's world was formed: if the join is still the one in flight for its world,
        hold `world` in its place (joined `now`, default the current time) and return True;
        False when it was called off (the caller drops `world`)."""
        name = join.assignment.name
        with self.lock:
            if self._joins.get(name) is not join:
                return False
            if world.assignment.name != name:
                raise RuleBroken(f"a join of world {name!r} installed world {world.assignment.name!r}")
            del self._joins[name]
            self._worlds[name] = world
            self._joined_at[name] = now if now is not None else datetime.now(UTC)
            join.world = world
            self._check()
            return True

    def give_up(self, join: Join) -> None:
        """The join in flight failed for good: drop it, and remember its epoch as given up."""
        a = join.assignment
        with self.lock:
            self._refuse_unless_current(join, "given up")
            del self._joins[a.name]
            self._given_up[a.name] = max(self._given_up.get(a.name, 0), a.epoch)
            self._check()

    def call_off(self, name: str) -> Join | None:
        """Call off the join of world `name` in flight (if any) and return it."""
        with self.lock:
            join = self._joins.pop(name, None)
            if join is not None:
                join.cancelled.set()
            self._check()
            return join

    def forget(self, name: str) -> World | None:
        """Leave world `name`: call off its join in flight and drop the world held (if any),
        which is returned for the caller to release."""
        with self.lock:
            self.call_off(name)
            world = self._worlds.pop(name, None)
            self._joined_at.pop(name, None)
            self._check()
            return world

    def close(self) -> tuple[list[World], list[Join]] | None:
        """Close for good: drop every world and join, and return them (the caller closes the
        worlds and calls off the joins); None when closed already."""
        with self.lock:
            if self._closed:
                return None
            self._closed = True
            worlds = list(self._worlds.values())
            joins = list(self._joins.values())
            self._worlds.clear()
            self._joined_at.clear()
            self._joins.clear()
            self._check()
            return worlds, joins

    def identify(self, plays: str) -> None:
        """A waiting spare was given its identity: it plays member pod `plays` (empty: its own)."""
        with self.lock:
            if not self._waiting:
                raise RuleBroken(f"an identity ({plays!r}) given to a process that waits for none")
            self._waiting = False
            self._plays = plays
            self._check()

    # -- watchers ----------------------------------------------------------------------------

    def watch(self, wake: Callable[[], object]) -> None:
        """Call `wake` once, at the next change (under the lock)."""
        self._watchers.append(wake)

    def take_watchers(self) -> list[Callable[[], object]]:
        """The watchers to wake for a change that happened (under the lock); they are called
        outside it, and each only once."""
        watchers, self._watchers = self._watchers, []
        return watchers

    # -- the rules ---------------------------------------------------------------------------

    def _refuse_filing(self, join: Join) -> None:
        """Refuse to file `join` where it would break a rule (under the lock)."""
        a = join.assignment
        if a.name in self._joins:
            pending = self._joins[a.name].assignment
            raise RuleBroken(f"world {a.name!r}: a join of epoch {a.epoch} beside one of epoch {pending.epoch}")
        if join.done.is_set() or join.cancelled.is_set():
            raise RuleBroken(f"world {a.name!r} epoch {a.epoch}: a finished or called off join filed")
        world = self._worlds.get(a.name)
        if world is not None and not (world.broken and world.assignment.epoch < a.epoch):
            raise RuleBroken(
                f"world {a.name!r}: a join of epoch {a.epoch} beside the world held at epoch "
                f"{world.assignment.epoch} ({'broken' if world.broken else 'healthy'})"
            )

    def _refuse_unless_current(self, join: Join, what: str) -> None:
        a = join.assignment
        if self._joins.get(a.name) is not join:
            raise RuleBroken(f"world {a.name!r} epoch {a.epoch}: a join not in flight {what}")

    def _check(self) -> None:
        """Every rule of the module's docstring (under the lock); RuleBroken names the first
        one broken."""
        for name, join in self._joins.items():
            a = join.assignment
            if a.name != name:
                raise RuleBroken(f"a join of world {a.name!r} filed as {name!r}")
            if join.done.is_set() or join.cancelled.is_set():
                raise RuleBroken(f"world {name!r} epoch {a.epoch}: a finished or called off join in flight")
        for name, world in self._worlds.items():
            held = world.assignment
            if held.name != name:
                raise RuleBroken(f"world {held.name!r} held as {name!r}")
            pending = self._joins.get(name)
            if pending is not None and not (world.broken and held.epoch < pending.assignment.epoch):
                raise RuleBroken(
                    f"world {name!r} held at epoch {held.epoch} ({'broken' if world.broken else 'healthy'}) "
                    f"beside its join of epoch {pending.assignment.epoch}"
                )
        if self._joined_at.keys() != self._worlds.keys():
            raise RuleBroken(f"joined_at names {sorted(self._joined_at)}, the worlds held are {sorted(self._worlds)}")
        if self._closed and (self._worlds or self._joins):
            raise RuleBroken("a closed manager holds or joins worlds")
        if self._waiting and self._plays:
            raise RuleBroken(f"a spare waiting for its identity plays {self._plays!r}")
