"""Which writes a store takes, by query and key. Any client may read a key it can name; no client
can list them (protocol.REFUSED).

A world's store takes every write: each key of an epoch lives under the epoch's secret, so only
its members can name one, and a member may break its own world. The beat store of a process
(detect/detector.py) is shared by every world it hosts, and each of their members knows the host
process's token, which names its counter and `news`: were they deletable or settable, a member
of one world could freeze them (a read of a missing key waits) or fill them with what no counter
holds, and so break the host's other worlds, which it holds no rank in. So the beat store takes
additions to counters and first writes of verdicts, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from multiworld.store.protocol import Query

READS = frozenset({Query.GET, Query.CHECK, Query.WAIT, Query.MULTI_GET, Query.GETNUMKEYS})


@dataclass(frozen=True)
class KeyRules:
    """The writes a store takes: each query with the key prefixes it may write (None: any)."""

    name: str
    writes: dict[Query, tuple[bytes, ...] | None]

    def permits(self, query: Query, key: bytes) -> bool:
        if query in READS:
            return True
        if query not in self.writes:
            return False
        prefixes = self.writes[query]
        return prefixes is None or key.startswith(prefixes)


WORLD_STORE = KeyRules(
    "world store",
    dict.fromkeys((Query.SET, Query.COMPARE_SET, Query.ADD, Query.DELETE_KEY, Query.APPEND, Query.MULTI_SET)),
)

# torch's client puts "/" before each key (protocol.py); detector.py names these keys.
BEAT_STORE = KeyRules("beat store", {Query.ADD: (b"/beat/", b"/news/"), Query.COMPARE_SET: (b"/verdict/",)})
