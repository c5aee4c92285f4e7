"""`multiworld operator`: kopf in standalone mode (kopf's own peering is not used: with
`lease`, replicas elect a leader on a Lease, leadership.py; without, this one acts alone)."""

from __future__ import annotations

import asyncio
import logging

import kopf

from . import handlers  # noqa: F401  (registers the handlers with kopf)
from .leadership import LeaseConfig


def run_operator(namespaces: list[str], liveness: str | None = None, lease: LeaseConfig | None = None) -> int:
    """Serve MultiWorlds in `namespaces` (every namespace when empty) until SIGINT/SIGTERM;
    `liveness` (e.g. http://0.0.0.0:8080/healthz) serves kopf's health endpoint. With `lease`,
    act only while holding it; a lost Lease stops the operator with status 1, so that its pod
    restarts as a standby."""
    # Our handlers only wake reconcile loops; kopf's line per handled event is noise at INFO.
    objects = logging.getLogger("kopf.objects")
    objects.setLevel(max(logging.WARNING, objects.getEffectiveLevel()))
    lost = asyncio.Event()
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
        memo=kopf.Memo(lease=lease, lease_lost=lost),
        stop_flag=lost,
    )
    return 1 if lost.is_set() else 0
