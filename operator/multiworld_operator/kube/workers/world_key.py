"""The key of every world's secrets (../world_secrets.py), one for every replica and across
restarts: kept in a Secret of the operator's namespace. The chart makes that Secret empty
(world-key.yaml: it goes with the release); whichever replica reads it first writes a random
key into it (an update at the resourceVersion it read: of replicas racing, one wins and the
others read what it wrote). A Secret that does not exist (an operator run without the chart) is
made the same way, with a create. The key is never rotated: another key hands the epochs that
run other secrets than their members hold.

Where: MULTIWORLD_WORLD_KEY_SECRET names the Secret (the chart sets `<fullname>-world-key`), in
POD_NAMESPACE. Unset (an operator run by hand, outside the cluster), this process makes a key of
its own and says so: a second replica, or this one restarted, then hands other secrets for the
same epochs. A key that changes (that, or the Secret deleted) breaks nothing for good: a running
world goes on with the secret its members hold, and a pod made after the change meets nobody at
its world's epoch, its join times out, and the world moves to a new epoch under the new key.

The Secret holds 32 random bytes; only the operator's ServiceAccount may read it (the chart's
Role). A tenant never sees it: it sees a world's secret only in the pods it owns.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
from collections.abc import Mapping

from kubernetes import client
from kubernetes.client.rest import ApiException

from multiworld_operator.kube.client.api import api_client
from multiworld_operator.kube.client.raced_secret import RacedSecret
from multiworld_operator.world_secrets import KEY_BYTES, new_key

log = logging.getLogger(__name__)

ENV_WORLD_KEY_SECRET = "MULTIWORLD_WORLD_KEY_SECRET"
# The Secret's data key.
DATA_KEY = "key"
# Reads and creates before a replica gives up (the Secret deleted again and again under it).
ATTEMPTS = 3


async def world_key(environ: Mapping[str, str] = os.environ) -> bytes:
    """The operator's world key, as the environment says where it is kept (the module's
    docstring); ValueError for a Secret named without a namespace, or one that holds no key."""
    name = environ.get(ENV_WORLD_KEY_SECRET, "")
    if not name:
        log.warning(
            "%s is not set: the worlds' secrets come from a key of this process alone, so another replica, or "
            "this one restarted, hands other secrets (worlds whose pods are made anew then move to a new epoch)",
            ENV_WORLD_KEY_SECRET,
        )
        return new_key()
    namespace = environ.get("POD_NAMESPACE", "")
    if not namespace:
        raise ValueError(f"{ENV_WORLD_KEY_SECRET}={name}: the Secret's namespace is $POD_NAMESPACE, which is not set")
    return await asyncio.to_thread(WorldKeySecret(namespace, name).read_or_make)


class WorldKeySecret:
    """The Secret `name` in `namespace` that holds the world key."""

    def __init__(self, namespace: str, name: str) -> None:
        self.namespace, self.name = namespace, name

    def read_or_make(self) -> bytes:
        """The key the Secret holds, written first if it holds none (blocking)."""
        with api_client() as api:
            secret = RacedSecret(client.CoreV1Api(api), self.namespace, self.name)
            for _ in range(ATTEMPTS):
                found = secret.read()
                if found is not None and DATA_KEY in (found.data or {}):
                    return self._key(found)
                made = new_key()
                data = {DATA_KEY: _encode(made)}
                if secret.create(data) if found is None else secret.replace(found, data):
                    log.info("wrote the world key into Secret %s/%s", self.namespace, self.name)
                    return made
            raise ApiException(
                status=409, reason=f"Secret {self.namespace}/{self.name} kept changing under this replica"
            )

    def _key(self, found: client.V1Secret) -> bytes:
        try:
            key = base64.b64decode((found.data or {}).get(DATA_KEY, ""), validate=True)
        except ValueError:
            key = b""
        if len(key) < KEY_BYTES:
            raise ValueError(
                f"Secret {self.namespace}/{self.name} holds no world key (at least {KEY_BYTES} bytes, base64, under "
                f"{DATA_KEY!r}): delete it, and the operator makes one (each world moves to a new epoch once)"
            )
        return key


def _encode(key: bytes) -> str:
    return base64.b64encode(key).decode()
