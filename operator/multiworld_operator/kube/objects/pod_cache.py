"""A MultiWorld's pods as the operator last saw them (pure): listed once, then kept current by
the pod watch's events and by the operator's own creates and deletes, so that a reconcile step
reads memory instead of listing (and parsing) every pod of the MultiWorld again.

A listing and the watch race: an event may predate the listing, or a listing may still hold a
pod whose deletion the watch already reported. resourceVersions order them (they are etcd's
revisions, integers, as Kubernetes' own watch cache compares them); a deleted pod leaves a
tombstone (the version it was deleted at, or the last version before) until a listing no longer
holds it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from multiworld_operator.kube.objects.observe import SeenPod, see_pod

# A fresh listing at least this often makes up for an event the watch lost.
RELIST_S = 60.0


class PodCache:
    """The pods of the MultiWorld with uid `owner_uid`, each read once per version (see_pod)."""

    def __init__(self, owner_uid: str) -> None:
        self.owner_uid = owner_uid
        self._pods: dict[str, tuple[int, SeenPod]] = {}
        self._gone: dict[str, int] = {}
        self._listed_at: float | None = None
        # Pod uid -> when this cache first saw that instance Running (the operator's clock).
        self._running_since: dict[str, datetime] = {}

    def stale(self) -> bool:
        """Whether a listing is due: never listed, or not for RELIST_S."""
        return self._listed_at is None or time.monotonic() - self._listed_at > RELIST_S

    def pods(self) -> list[SeenPod]:
        return [pod for _, pod in self._pods.values()]

    def ours(self, pod: str, uid: str) -> bool:
        """Whether that instance (by uid) is one of this MultiWorld's pods and not being deleted."""
        cached = self._pods.get(pod)
        return cached is not None and cached[1].uid == uid and cached[1].observation is not None

    def listed(self, items: Sequence[Mapping[str, Any]], version: str) -> None:
        """Take a listing made at resourceVersion `version`; what the watch reported since wins."""
        at = _version(version)
        fresh: dict[str, tuple[int, SeenPod]] = {}
        for item in items:
            name, seen = _identity(item)
            if name in self._gone and seen <= self._gone[name]:
                continue  # that instance is known to be deleted: the listing predates it
            cached = self._pods.get(name)
            fresh[name] = cached if cached is not None and cached[0] >= seen else (seen, self._see(item))
        for name, cached in self._pods.items():
            if name not in fresh and cached[0] > at:
                fresh[name] = cached  # created after the listing
        # A deletion the listing no longer shows needs no tombstone.
        listed = {item["metadata"]["name"] for item in items}
        self._gone = {name: when for name, when in self._gone.items() if name in listed}
        self._pods = fresh
        self._listed_at = time.monotonic()
        uids = {pod.uid for _, pod in fresh.values()}
        self._running_since = {uid: at for uid, at in self._running_since.items() if uid in uids}

    def changed(self, deleted: bool, item: Mapping[str, Any]) -> bool:
        """Take one pod as a watch event (or a create's or delete's response) gave it; False
        when it is older than what is known."""
        name, seen = _identity(item)
        cached = self._pods.get(name)
        # A delete's response carries the version it deleted: as new as the cached one.
        if cached is not None and (cached[0] > seen or (cached[0] == seen and not deleted)):
            return False
        if name in self._gone and self._gone[name] >= seen:
            return False
        if deleted:
            gone = self._pods.pop(name, None)
            if gone is not None:
                self._running_since.pop(gone[1].uid, None)
            self._gone[name] = seen
        else:
            self._pods[name] = (seen, self._see(item))
        return True

    def _see(self, item: Mapping[str, Any]) -> SeenPod:
        """see_pod, with the moment this cache first saw the instance Running."""
        status = item.get("status") or {}
        uid = str(item["metadata"].get("uid", ""))
        since = None
        if status.get("phase") == "Running":
            since = self._running_since.setdefault(uid, datetime.now(UTC))
        return see_pod(item, self.owner_uid, since)


def _identity(item: Mapping[str, Any]) -> tuple[str, int]:
    """A pod's name and its version."""
    meta = item["metadata"]
    return meta["name"], _version(str(meta.get("resourceVersion", "")))


def _version(value: str) -> int:
    """A resourceVersion as an integer (-1 when there is none)."""
    return int(value) if value.isdigit() else -1
