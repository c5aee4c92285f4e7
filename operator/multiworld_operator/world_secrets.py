"""Each world's secret at each epoch, which the platform hands to that epoch's members only
(both platforms: the operator and the local runner).

Rank 0's store (torch's TCPStore) answers anything that reaches its port, with no
authentication of its own. Every store key of a world at an epoch lives under a prefix that
holds the epoch's secret (`multiworld.contract.store_prefix`), so a process that was not handed
it, one that holds no rank in the world at that epoch, cannot name any of them: neither read the
members' entries nor write a claim, a verdict or gloo's own keys. The platform hands the secret
with the world's entry (`WorldEntry.secret`, over the worker channel, which proves which pod
speaks) and with the start-up assignments (`WorldAssignment.secret`, in the pod's env).

The planner stays pure: its table and its assignments carry no secret; the platform fills them
in as they go out. A secret is an HMAC of (scope, world, epoch) under the platform's key, so
the same epoch always gets the same secret: across a restart and on every replica of the
operator (they share one key: kube/workers/world_key.py), and the env of a pod made for an epoch
agrees with the table of that epoch. `scope` names the MultiWorld (the operator: its namespace,
name and uid, so a MultiWorld made again under the same name shares no secret with the one
before). The local runner makes a key of its own per run.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from multiworld.contract import WorldAssignment, WorldTable
from multiworld_operator.planner import CreatePod

# The key's length (bytes), and a secret's (hex digits: 128 bits).
KEY_BYTES = 32
SECRET_HEX = 32


def new_key() -> bytes:
    """A fresh random key."""
    return secrets.token_bytes(KEY_BYTES)


class WorldSecrets:
    """The secrets of one MultiWorld's worlds under `key`."""

    def __init__(self, key: bytes, scope: str) -> None:
        if len(key) < KEY_BYTES:
            raise ValueError(f"a world key has at least {KEY_BYTES} bytes, not {len(key)}")
        self._key = key
        self._scope = scope

    def secret(self, world: str, epoch: int) -> str:
        message = "\0".join((self._scope, world, str(epoch))).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:SECRET_HEX]

    def table(self, table: WorldTable) -> WorldTable:
        """`table` with every entry's secret (what the platform sends its workers)."""
        worlds = [w.model_copy(update={"secret": self.secret(w.name, w.epoch)}) for w in table.worlds]
        return table.model_copy(update={"worlds": worlds})

    def assignments(self, worlds: list[WorldAssignment]) -> list[WorldAssignment]:
        return [a.model_copy(update={"secret": self.secret(a.name, a.epoch)}) for a in worlds]

    def create(self, create: CreatePod) -> CreatePod:
        """`create` with its start-up assignments' secrets (the pod's env)."""
        return create.model_copy(update={"worlds": self.assignments(create.worlds)})
