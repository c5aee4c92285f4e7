"""A MultiWorld's pods as the operator last saw them (pure): listed once, then kept current by
the pod watch's events and by the operator's own creates and deletes, so that a reconcile step
reads memory instead of listing (and parsing) every pod of the MultiWorld again.

A listing and the watch race: an event may predate the listing, or a listing may still hold a
pod whose deletion the watch already reported. resourceVersions order them (they are etcd's
revisions, integers, as Kubernetes' own watch cache compares them); a deleted pod leaves a
tombstone until a listing newer than its deletion.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from .observe import KubePod

# A fresh listing at least this often makes up for an event the watch lost.
RELIST_S = 60.0


class PodCache:
    def __init__(self) -> None:
        self._pods: dict[str, tuple[int, KubePod]] = {}
        self._gone: dict[str, int] = {}
        self._listed_at: float | None = None

    def stale(self) -> bool:
        """Whether a listing is due: never listed, or not for RELIST_S."""
        return self._listed_at is None or time.monotonic() - self._listed_at > RELIST_S

    def pods(self) -> list[KubePod]:
        return [pod for _, pod in self._pods.values()]

    def listed(self, items: list[Mapping[str, Any]], version: str) -> None:
        """Take a listing made at resourceVersion `version`; what the watch reported since wins."""
        at = _version(version)
        fresh: dict[str, tuple[int, KubePod]] = {}
        for item in items:
            pod = KubePod.model_validate(item)
            name, seen = pod.metadata.name, _version(pod.metadata.resource_version)
            if self._gone.get(name, -1) > at:
                continue  # deleted after the listing
            cached = self._pods.get(name)
            fresh[name] = cached if cached is not None and cached[0] > seen else (seen, pod)
        for name, cached in self._pods.items():
            if name not in fresh and cached[0] > at:
                fresh[name] = cached  # created after the listing
        self._pods = fresh
        self._gone = {name: when for name, when in self._gone.items() if when > at}
        self._listed_at = time.monotonic()

    def changed(self, deleted: bool, item: Mapping[str, Any]) -> bool:
        """Take one pod as a watch event (or a create's or delete's response) gave it; False
        when it is older than what is known."""
        pod = KubePod.model_validate(item)
        name, seen = pod.metadata.name, _version(pod.metadata.resource_version)
        cached = self._pods.get(name)
        if (cached is not None and cached[0] >= seen) or self._gone.get(name, -1) >= seen:
            return False
        if deleted:
            self._pods.pop(name, None)
            self._gone[name] = seen
        else:
            self._pods[name] = (seen, pod)
        return True


def _version(value: str) -> int:
    return int(value) if value.isdigit() else -1
