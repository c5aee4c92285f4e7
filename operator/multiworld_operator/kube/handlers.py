"""The kopf handlers: thin. They watch MultiWorlds, the pods, Services and NetworkPolicies
labelled with one (the memory's ConfigMap is not watched: memory_store.py), and wake that
MultiWorld's reconcile loop (controller.py), which observes, plans and executes; with leader
election (the memo's `lease`, main.py), loops run only while this replica leads (leadership.py),
and every replica watches all the same. At start the operator reads the key of the worlds'
secrets (world_key.py) and begins serving the worker channel (channel_settings.py says where). No
handler writes to the API itself, so kopf keeps no state on the MultiWorld: no finalizer, no
annotations (deleting a MultiWorld never waits for the operator).
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import kopf

from multiworld_operator.kube.client.api import CONCURRENCY, KubeApi, api_client
from multiworld_operator.kube.client.api_basics import REQUEST_TIMEOUT_S
from multiworld_operator.kube.controller import Controller
from multiworld_operator.kube.leadership import Leadership
from multiworld_operator.kube.metrics.access import MAX_CHECKS, MetricsAccess
from multiworld_operator.kube.metrics.registry import OperatorMetrics
from multiworld_operator.kube.objects.bodies import NAME_LABEL
from multiworld_operator.kube.workers.channel_settings import ChannelSettings
from multiworld_operator.kube.workers.world_key import world_key
from multiworld_operator.spec.resource import API_GROUP, API_VERSION, PLURAL

log = logging.getLogger(__name__)

# Watches end server-side after this long and are re-established; the client gives up a bit
# later on a connection that went silent.
# An integer: the API server refuses a fractional timeoutSeconds.
WATCH_SERVER_TIMEOUT_S = 300
WATCH_CLIENT_TIMEOUT_S = 330.0
CONNECT_TIMEOUT_S = 10.0


class _NoEssence(kopf.DiffBaseStorage):
    """Every handler here is an event handler: nothing is diffed, so no essence is kept. kopf's
    own storage deep-copies every watched body on every event to build one, which for a
    MultiWorld of thousands of worlds blocks the event loop on every event (bench/scale.py
    measures the operator at such sizes)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return cast(kopf.BodyEssence, {})

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        pass


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    if memo.get("liveness") is not None:
        memo.liveness.start()
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT_S
    settings.watching.connect_timeout = CONNECT_TIMEOUT_S
    settings.networking.request_timeout = REQUEST_TIMEOUT_S
    settings.networking.connect_timeout = CONNECT_TIMEOUT_S
    settings.persistence.diffbase_storage = _NoEssence()
    # Only our objects travel: the API server filters by label, not kopf after it.
    for group_version, plural in (("v1", "pods"), ("v1", "services"), ("networking.k8s.io/v1", "networkpolicies")):
        settings.watching.label_selectors[group_version, plural] = NAME_LABEL
    channel = ChannelSettings.from_env(os.environ)
    # Threads for the blocking client: a reconcile step keeps up to CONCURRENCY requests in flight.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2 * CONCURRENCY, "kube-api"))
    lease = memo.get("lease")
    metrics = OperatorMetrics()
    # Every world's secrets derive from one key, the same on every replica (world_key.py).
    key = await world_key(os.environ)
    memo.controller = Controller(
        KubeApi(api_client(), on_error=metrics.api_error), metrics, leading=lease is None, world_key=key
    )
    await memo.controller.start(channel)
    if memo.get("metrics_port") is not None:
        serve_metrics(metrics, memo)
    if lease is not None:
        # Its own threads: a renew must not queue behind the requests of large steps.
        api = KubeApi(api_client(), lease.request_timeout_s, ThreadPoolExecutor(2, "lease"), metrics.api_error)
        memo.leadership = Leadership(api, lease, memo.controller, on_lost=memo.lease_lost.set)
        memo.leadership.start()


def serve_metrics(metrics: OperatorMetrics, memo: kopf.Memo) -> None:
    """Serve the metrics on the memo's `metrics_port`: with `metrics_secure` (the default), over
    TLS (the webhook's certificate where the memo's `certificate` serves one) to the bearer
    tokens allowed `get` on /metrics, checked in threads of their own; else plain HTTP."""
    if not memo.get("metrics_secure", True):
        port = metrics.serve(memo.metrics_port)
        log.warning("metrics at http://0.0.0.0:%d/metrics, to anyone who can connect", port)
        return
    checks = KubeApi(
        api_client(), executor=ThreadPoolExecutor(MAX_CHECKS, "metrics-access"), on_error=metrics.api_error
    )
    port = metrics.serve(memo.metrics_port, MetricsAccess(checks))
    if memo.get("certificate") is not None and metrics.server is not None:
        memo.certificate.follow(metrics.server.use_certificate)
    log.info("metrics at https://0.0.0.0:%d/metrics, to a bearer token allowed to get /metrics", port)


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    """Every watch has ended: the loops stop, then the Lease is released."""
    if memo.get("liveness") is not None:
        await memo.liveness.stop()
    if "leadership" in memo:
        await memo.leadership.stop()
    await memo.controller.stop()
    memo.controller.metrics.close()


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def multiworld_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    await memo.controller.multiworld_changed(event["object"], deleted=event["type"] == "DELETED")


@kopf.on.event("", "v1", "pods", labels={NAME_LABEL: kopf.PRESENT})
async def pod_event(
    event: kopf.RawEvent, namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> None:
    assert namespace is not None  # pods are namespaced (kopf's None is for cluster-wide objects)
    memo.controller.pod_changed(namespace, labels[NAME_LABEL], event["type"] == "DELETED", event["object"])


@kopf.on.event("", "v1", "services", labels={NAME_LABEL: kopf.PRESENT})
async def service_event(
    event: kopf.RawEvent, namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> None:
    assert namespace is not None  # services are namespaced
    if event["type"] == "DELETED":
        memo.controller.service_deleted(namespace, labels[NAME_LABEL], event["object"])


@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels={NAME_LABEL: kopf.PRESENT})
async def network_policy_event(
    event: kopf.RawEvent, namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> None:
    """Deleted or edited by anyone but the operator: its MultiWorld's loop makes it whole again."""
    assert namespace is not None  # network policies are namespaced
    memo.controller.network_policy_changed(namespace, labels[NAME_LABEL], event["type"] == "DELETED", event["object"])
