"""The members' handshake in a world's store, before the communicator is built.

Keys (under the epoch prefix `<world>/<epoch>/<secret>/`, `contract.store_prefix`):
`claim/<rank>` (one process per rank), `member/<rank>` (what each member was told: size,
backend, pod, and its failure detector's token and port: see detector.py), `abort` (a verdict:
empty while healthy). Rank 0's store answers anything that reaches its port, with no
authentication of its own: the secret, which the controller hands only to the epoch's members,
is what keeps every other process from naming (reading or writing) any of these keys.

A world without a secret (no controller hands one: pymultiworld's `initialize_world`, a
hand-made env) has its keys under `<world>/<epoch>/`, open to anyone who reaches the store, and
one key outside the prefix: `<world>/epoch`, the newest epoch any member has asked for, so an
older one is refused at once, and from which `next_epoch` reads which epoch a process joins
where no controller numbers them. A world with a secret neither writes nor reads it (anyone
could set it to 999 and move the world): its controller numbers the epochs and tells the
members of a newer one through the table, and a member that moves on closes the older epoch
with a verdict under that epoch's prefix.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping

from torch.distributed import Store

from multiworld.contract import WorldAssignment, store_prefix
from multiworld.detect.verdicts import Verdict, abort_key, epoch_key
from multiworld.errors import JoinCancelled, JoinTimedOut, StaleEpochError, StoreLost, WorldJoinError, short

# How often a waiting member looks for the others: the bound on how late it notices them.
_POLL = 0.02


def claim_key(prefix: str, rank: int) -> str:
    return f"{prefix}claim/{rank}"


def next_epoch(store: Store, world: str, rank: int, held: int) -> int:
    """The epoch that `rank` joins, read from the world's store, where no controller numbers
    them. `held`: the newest epoch of the world this process held (0: none).

    The current epoch while it is forming with `rank` free and no verdict in it; otherwise the
    one after, so that the survivors of a broken world and a restarted peer meet there. A
    process that held an older epoch and finds its rank taken at the current one was replaced
    there: refused, so it can never break into the world that replaced it.
    """
    key = epoch_key(world)
    current = int(store.get(key)) if store.check([key]) else 0
    if current <= held:
        return held + 1
    prefix = store_prefix(world, current)
    if store.check([claim_key(prefix, rank)]):
        if held:
            raise StaleEpochError(
                f"world {world!r}: rank {rank} was taken at epoch {current} by another process; "
                f"this process held epoch {held} and was replaced"
            )
        return current + 1  # a restarted process whose earlier instance held the rank
    verdict = abort_key(prefix)
    if store.check([verdict]) and store.get(verdict):
        return current + 1
    return current


class Rendezvous:
    def __init__(
        self,
        store: Store,
        assignment: WorldAssignment,
        *,
        pod: str,
        deadline: float,
        cancelled: threading.Event,
        beat: Mapping[str, object] | None = None,
    ) -> None:
        """`beat`: what this member's failure detector announces to the others."""
        self._store = store
        self._a = assignment
        self._pod = pod
        self._beat = dict(beat or {})
        self._deadline = deadline
        self._cancelled = cancelled
        self._prefix = assignment.store_prefix
        self._what = f"world {assignment.name!r} epoch {assignment.epoch}"
        self._claim_key = claim_key(self._prefix, assignment.rank)

    def run(self) -> list[dict[str, object]]:
        """Return what each member announced, by rank, when every member of this epoch is
        present and agrees; raise otherwise."""
        self._guarded(self._fence_epoch)
        self._guarded(self._claim_rank)
        members: list[dict[str, object]] = []
        try:
            self._guarded(self._open_abort_key)
            if self._a.rank != 0:
                self._guarded(self._check_rank0)
            self._guarded(self._announce)
            self._guarded(lambda: members.extend(self._wait_for_members()))
            self._guarded(lambda: self._check_members(members))
        except WorldJoinError:
            # Free the rank again, so that this epoch can be joined later (best effort).
            try:
                self._store.delete_key(self._claim_key)
            except Exception:
                pass
            raise
        return members

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except WorldJoinError:
            raise
        except Exception as exc:  # the store went away under us
            raise StoreLost(f"{self._what}: rendezvous failed: {short(exc)}") from exc

    def _fence_epoch(self) -> None:
        if self._a.secret:
            return  # the controller numbers the epochs (see the module's docstring)
        key, mine = epoch_key(self._a.name), str(self._a.epoch)
        current = self._store.compare_set(key, "", mine).decode()
        while current != mine:
            if int(current) > self._a.epoch:
                raise StaleEpochError(f"{self._what} is stale: the world is at epoch {current}")
            current = self._store.compare_set(key, current, mine).decode()
            if current == mine:
                return

    def _claim_rank(self) -> None:
        if self._store.add(self._claim_key, 1) != 1:
            raise WorldJoinError(f"{self._what}: rank {self._a.rank} is already taken by another process")

    def _open_abort_key(self) -> None:
        # It exists before this member waits or shows itself, so that no read of it waits.
        self._store.compare_set(abort_key(self._prefix), "", "")

    def _check_rank0(self) -> None:
        """Rank 0's entry, checked before this member shows itself: a member told a different
        size learns it without waiting for ranks that will never come, and while rank 0's store
        is sure to be up (rank 0 leaves as soon as it sees a member that disagrees)."""
        key = self._member_key(0)
        self._wait([key])
        self._check_members([json.loads(self._store.get(key))])

    def _announce(self) -> None:
        info = {"size": self._a.size, "backend": self._a.backend, "pod": self._pod, **self._beat}
        self._store.set(self._member_key(self._a.rank), json.dumps(info))

    def _member_key(self, rank: int) -> str:
        return f"{self._prefix}member/{rank}"

    def _wait_for_members(self) -> list[dict[str, object]]:
        keys = [self._member_key(r) for r in range(self._a.size)]
        self._wait(keys)
        return [json.loads(raw) for raw in self._store.multi_get(keys)]

    def _check_members(self, members: list[dict[str, object]]) -> None:
        for rank, info in enumerate(members):
            for field, mine in (("size", self._a.size), ("backend", self._a.backend)):
                if info.get(field) != mine:
                    reason = (
                        f"{field} mismatch: rank {rank} (pod {info.get('pod') or '?'}) has {field} "
                        f"{info.get(field)!r}, rank {self._a.rank} (pod {self._pod or '?'}) has {mine!r}"
                    )
                    verdict = Verdict(reason=reason, by_rank=self._a.rank)
                    self._store.compare_set(abort_key(self._prefix), "", verdict.encode())
                    raise WorldJoinError(f"{self._what}: {reason}")

    def _wait(self, keys: list[str]) -> None:
        # Polling with check() rather than wait(timeout): a timed-out wait logs a warning from
        # C++ every time, and members may wait minutes for a pod to start.
        while not self._store.check(keys):
            self._still_wanted(keys)
            self._cancelled.wait(_POLL)

    def _still_wanted(self, keys: list[str]) -> None:
        if self._cancelled.is_set():
            raise JoinCancelled(self._a.name)
        rejected = self._store.get(abort_key(self._prefix))
        if rejected:
            raise WorldJoinError(f"{self._what} was rejected: {Verdict.decode(rejected).describe()}")
        current = 0 if self._a.secret else int(self._store.get(epoch_key(self._a.name)))
        if current > self._a.epoch:
            raise StaleEpochError(f"{self._what} is stale: the world moved on to epoch {current}")
        if time.monotonic() >= self._deadline:
            missing = [k.rsplit("/", 1)[1] for k in keys if not self._store.check([k])]
            raise JoinTimedOut(f"{self._what}: timed out waiting for rank(s) {', '.join(missing)}")
