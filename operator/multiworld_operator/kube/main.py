"""`multiworld operator`: kopf in standalone mode (one operator acts alone; no peering)."""

from __future__ import annotations

import logging

import kopf

from . import handlers  # noqa: F401  (registers the handlers with kopf)
from .admission import Webhook, enable


def run_operator(namespaces: list[str], liveness: str | None = None, webhook: Webhook | None = None) -> int:
    """Serve MultiWorlds in `namespaces` (every namespace when empty) until SIGINT/SIGTERM;
    `liveness` (e.g. http://0.0.0.0:8080/healthz) serves kopf's health endpoint; `webhook`, the
    validating admission webhook."""
    # Our handlers only wake reconcile loops; kopf's line per handled event is noise at INFO, and
    # so is aiohttp's per call of the webhook (a refusal is kopf's error line).
    for name in ("kopf.objects", "aiohttp.access"):
        logger = logging.getLogger(name)
        logger.setLevel(max(logging.WARNING, logger.getEffectiveLevel()))
    settings = kopf.OperatorSettings()
    if webhook is not None:
        enable(webhook, settings, kopf.get_default_registry())
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
        settings=settings,
    )
    return 0
