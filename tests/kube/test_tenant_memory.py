"""A tenant writes its MultiWorld's memory ConfigMap (issue 32 finding 3): the ConfigMap is in
the tenant's namespace, and a tenant with `edit` there may write it. Before, the operator
inflated up to 32 MiB of it and parsed it whole on its event loop: 11 KiB of gzip cost it
hundreds of MiB, past the chart's memory limit, at every restart.

Here the tenant, with its own credentials, writes gzip of 30 MiB of JSON objects, or of JSON
nested far past any parser's depth, while the operator is down. The operator that starts next
reads no more than its bounds (kube/memory/planner_memory.py): it stays far below the chart's memory
limit, it rebuilds that MultiWorld's memory from the cluster (one Warning Event, no pod
deleted), and it keeps serving the tenant's other MultiWorld, whose failure it recovers as
usual.
"""

from __future__ import annotations

import base64
import gzip
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client

from multiworld_operator.kube.memory.memory_store import MEMORY_REBUILT
from multiworld_operator.kube.memory.planner_memory import MEMORY_KEY
from tests.cluster.cluster import Cluster
from tests.support.operator_support import (
    Kubelet,
    KubeNamespace,
    cluster_release,
    refusals,
    two_worlds,
    wait_for,
)
from tests.support.tenant import CHART_LIMIT_MIB, operator_process, peak_rss_mib, tenant_api

pytestmark = pytest.mark.kube


def _objects() -> bytes:
    """JSON of ten million empty objects (30 MiB; 30 KiB of gzip): 25 times that once parsed."""
    return b"[" + b"{}," * (10_000_000 - 1) + b"{}]"


def _deep() -> bytes:
    """JSON nested ten million arrays deep."""
    return b"[" * 10_000_000


@pytest.mark.parametrize("junk", [_objects, _deep], ids=["objects", "deep"])
def test_a_tenants_memory_configmap_costs_the_operator_a_bounded_amount(
    kube_cluster: Cluster, namespace: str, tmp_path: Path, junk: Callable[[], bytes]
) -> None:
    kubeconfig = cluster_release(kube_cluster).operator_kubeconfig
    log_path = tmp_path / "operator.log"
    with kube_cluster.api_client() as api, Kubelet(api, namespace) as kubelet:
        kube = KubeNamespace(api, namespace)
        tenant = client.CoreV1Api(tenant_api(kube_cluster, api, namespace))
        with operator_process(kubeconfig, namespace, log_path):
            kube.create(two_worlds("mine"))
            kube.create(two_worlds("other"))
            kube.wait_running("mine", epochs={"wa": 1, "wb": 1})
            kube.wait_running("other", epochs={"wa": 1, "wb": 1})
        before = kube.uids("mine")
        packed = gzip.compress(junk(), compresslevel=9)
        assert len(packed) < 1024 * 1024  # it fits in a ConfigMap
        tenant.patch_namespaced_config_map(
            "mine", namespace, {"binaryData": {MEMORY_KEY: base64.b64encode(packed).decode()}}
        )

        with operator_process(kubeconfig, namespace, log_path) as operator:
            rebuilt = wait_for(
                "mine's memory rebuilt", lambda: [e for e in kube.events("mine") if e.reason == MEMORY_REBUILT]
            )
            kubelet.fail("other-a-0")
            kube.wait_running("other", epochs={"wa": 2, "wb": 1})
            kube.wait_running("mine", epochs={"wa": 1, "wb": 1})
            assert operator.poll() is None
            peak = peak_rss_mib(operator)
        assert len(rebuilt) == 1 and rebuilt[0].type == "Warning", rebuilt
        assert kube.uids("mine") == before  # no pod of the tenant's deleted for it
        log = log_path.read_text(errors="replace")
        assert not refusals(log), log
        assert peak < CHART_LIMIT_MIB / 2, (peak, log[-3000:])
