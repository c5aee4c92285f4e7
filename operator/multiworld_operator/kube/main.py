"""`multiworld operator`: kopf in standalone mode (kopf's own peering is not used: with
`lease`, replicas elect a leader on a Lease, leadership.py; without, this one acts alone)."""

from __future__ import annotations

import asyncio
import logging

import kopf

from multiworld_operator.kube import handlers  # noqa: F401  (registers the handlers with kopf)
from multiworld_operator.kube.admission.webhook import Webhook, enable
from multiworld_operator.kube.client.nesting import allow_api_depth
from multiworld_operator.kube.leadership import LeaseConfig
from multiworld_operator.kube.liveness import Liveness


def run_operator(
    namespaces: list[str],
    liveness: Liveness | None = None,
    webhook: Webhook | None = None,
    lease: LeaseConfig | None = None,
    metrics_port: int | None = None,
    metrics_secure: bool = True,
) -> int:
    """Serve MultiWorlds in `namespaces` (every namespace when empty) until SIGINT/SIGTERM;
    `liveness` answers probes while the event loop turns (liveness.py); `metrics_port`,
    Prometheus metrics at /metrics (metrics.py; `metrics_secure`: over HTTPS to a bearer token
    allowed to get /metrics, else plain HTTP to anyone); `webhook`, the
    validating admission webhook. With `lease`, act only while holding it; a lost Lease stops the
    operator with status 1, so that its pod restarts as a standby."""
    # Our handlers only wake reconcile loops: kopf's lines at INFO (a handler or an activity
    # succeeded, the webhook reconfigured) are noise, and so is aiohttp's per call of the webhook
    # (a refusal is kopf's error line). They show at DEBUG (-vv) only.
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("kopf", "aiohttp.access"):
            logging.getLogger(name).setLevel(logging.WARNING)
    allow_api_depth()
    settings = kopf.OperatorSettings()
    certificate = None if webhook is None else enable(webhook, settings, kopf.get_default_registry())
    lost = asyncio.Event()
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        settings=settings,
        memo=kopf.Memo(
            lease=lease,
            lease_lost=lost,
            liveness=liveness,
            metrics_port=metrics_port,
            metrics_secure=metrics_secure,
            certificate=certificate,
        ),
        stop_flag=lost,
    )
    return 1 if lost.is_set() else 0
