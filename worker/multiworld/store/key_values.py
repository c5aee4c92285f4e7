"""One store's keys and values, and the clients waiting for keys: what each request does to them,
within the store's rules and its memory bounds. Pure: the server (server.py) does the I/O.

Each key is charged to the source that wrote it last (its address): the bytes a store holds,
and those any one source other than this machine holds, are bounded, so a client that writes
names of its own costs the store's process that much at most. This machine's own processes
(loopback) are charged to the whole only: a local run's members all come from loopback, and a
pod's processes are its owner's, whose worlds they may break anyway.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable

from multiworld.store.protocol import (
    NOT_READY,
    READY,
    Query,
    Refused,
    Request,
    number_reply,
    value_reply,
)
from multiworld.store.rules import KeyRules

MAX_HELD_BYTES = 1024 * 1024 * 1024
MAX_HELD_BYTES_PER_SOURCE = 64 * 1024 * 1024
# What an entry costs beyond its key and value (the dict's slot, two bytes objects).
ENTRY_OVERHEAD = 128

_INT64 = 1 << 64
# What C++'s stoll (torch's server) reads of a counter: leading space, a sign, digits.
_NUMBER = re.compile(rb"\s*([+-]?\d+)")


def _wrapped(number: int) -> int:
    """A sum as a 64-bit counter holds it: a counter only needs to move, so one pushed past the
    range wraps instead of refusing its owner's next addition."""
    return (number + (1 << 63)) % _INT64 - (1 << 63)


class KeyValues:
    def __init__(self, rules: KeyRules) -> None:
        self.rules = rules
        self._values: dict[bytes, bytes] = {}
        self._charged: dict[bytes, Hashable] = {}  # key -> the source its entry is charged to
        self._held = 0
        self._held_by: dict[Hashable, int] = {}
        # A waiting client's keys, and for each key the clients waiting for it.
        self._waits: dict[Hashable, tuple[bytes, ...]] = {}
        self._waiting_for: dict[bytes, set[Hashable]] = {}

    @property
    def held(self) -> int:
        return self._held

    def held_by(self, source: Hashable) -> int:
        return self._held_by.get(source, 0)

    def answer(self, request: Request, source: Hashable, *, local: bool) -> tuple[bytes | None, list[Hashable]]:
        """What `source` (`local`: this machine) gets for `request`, if anything, and the
        waiting clients whose keys now all exist. WAIT and CANCEL_WAIT are `wait`'s and
        `cancel`'s. Refused past a rule or a bound, with nothing changed."""
        query = request.query
        for key in request.keys:
            if not self.rules.permits(query, key):
                raise Refused("not permitted", f"the {self.rules.name} takes no {query.name} of {key[:80]!r}")
        keys, values = request.keys, request.values
        if query is Query.GET:
            return value_reply(self._values.get(keys[0], b"")), []
        if query is Query.MULTI_GET:
            return b"".join(value_reply(self._values.get(key, b"")) for key in keys), []
        if query is Query.CHECK:
            return (READY if all(key in self._values for key in keys) else NOT_READY), []
        if query is Query.GETNUMKEYS:
            return number_reply(len(self._values)), []
        if query is Query.DELETE_KEY:
            return number_reply(int(self._delete(keys[0]))), []
        if query is Query.SET or query is Query.MULTI_SET:
            return None, self._write(zip(keys, values, strict=True), source, local)
        if query is Query.APPEND:
            return None, self._write([(keys[0], self._values.get(keys[0], b"") + values[0])], source, local)
        if query is Query.ADD:
            total = _wrapped(self._number(keys[0]) + request.number)
            return number_reply(total), self._write([(keys[0], str(total).encode())], source, local)
        if query is Query.COMPARE_SET:
            return self._compare_set(keys[0], values[0], values[1], source, local)
        raise Refused("junk", f"{query.name} is no request on its own")

    def wait(self, client: Hashable, keys: tuple[bytes, ...]) -> bool:
        """Whether `keys` all exist now; if not, `client` waits for them (one wait a client)."""
        missing = tuple(key for key in keys if key not in self._values)
        if not missing:
            return True
        self.cancel(client)
        self._waits[client] = keys
        for key in missing:
            self._waiting_for.setdefault(key, set()).add(client)
        return False

    def cancel(self, client: Hashable) -> bool:
        """Ends `client`'s wait; whether it had one."""
        keys = self._waits.pop(client, None)
        if keys is None:
            return False
        for key in keys:
            waiting = self._waiting_for.get(key)
            if waiting is not None:
                waiting.discard(client)
                if not waiting:
                    del self._waiting_for[key]
        return True

    def _number(self, key: bytes) -> int:
        value = self._values.get(key)
        if value is None:
            return 0
        found = _NUMBER.match(value)
        if found is None:
            raise Refused("not a number", f"an addition to {key[:80]!r}, which holds no number")
        return int(found.group(1))

    def _compare_set(
        self, key: bytes, expected: bytes, desired: bytes, source: Hashable, local: bool
    ) -> tuple[bytes, list[Hashable]]:
        current = self._values.get(key)
        if current is None and expected:
            return value_reply(expected), []
        if current is not None and current != expected:
            return value_reply(current), []
        return value_reply(desired), self._write([(key, desired)], source, local)

    def _write(self, written: Iterable[tuple[bytes, bytes]], source: Hashable, local: bool) -> list[Hashable]:
        pairs = dict(written)
        freed: dict[Hashable, int] = {}
        for key in pairs:
            old = self._values.get(key)
            if old is not None:
                owner = self._charged[key]
                freed[owner] = freed.get(owner, 0) + ENTRY_OVERHEAD + len(key) + len(old)
        cost = sum(ENTRY_OVERHEAD + len(key) + len(value) for key, value in pairs.items())
        if self._held - sum(freed.values()) + cost > MAX_HELD_BYTES:
            raise Refused("full", f"the store holds {self._held} bytes; {cost} more would pass {MAX_HELD_BYTES}")
        if not local:
            mine = self.held_by(source) - freed.get(source, 0) + cost
            if mine > MAX_HELD_BYTES_PER_SOURCE:
                raise Refused("full", f"the source would hold {mine} bytes, over {MAX_HELD_BYTES_PER_SOURCE}")
        for key in pairs:
            self._delete(key)
        woken: list[Hashable] = []
        for key, value in pairs.items():
            self._values[key] = value
            self._charge(key, source, ENTRY_OVERHEAD + len(key) + len(value))
            woken.extend(self._woken_by(key))
        return woken

    def _charge(self, key: bytes, source: Hashable, size: int) -> None:
        self._charged[key] = source
        self._held += size
        self._held_by[source] = self._held_by.get(source, 0) + size

    def _delete(self, key: bytes) -> bool:
        value = self._values.pop(key, None)
        if value is None:
            return False
        owner = self._charged.pop(key)
        size = ENTRY_OVERHEAD + len(key) + len(value)
        self._held -= size
        left = self._held_by[owner] - size
        if left:
            self._held_by[owner] = left
        else:
            del self._held_by[owner]
        return True

    def _woken_by(self, key: bytes) -> list[Hashable]:
        """The clients waiting for `key` whose keys now all exist (their waits end)."""
        woken = []
        for client in list(self._waiting_for.get(key, ())):
            if all(k in self._values for k in self._waits[client]):
                self.cancel(client)
                woken.append(client)
        return woken
