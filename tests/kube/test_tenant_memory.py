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
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kubernetes import client

from multiworld_operator.kube.memory.memory_store import MEMORY_REBUILT
from multiworld_operator.kube.memory.planner_memory import MEMORY_KEY
from multiworld_operator.kube.workers.channel_settings import ENV_CHANNEL_PORT
from tests.cluster.cluster import Cluster
from tests.support.operator_support import (
    Kubelet,
    KubeNamespace,
    cluster_release,
    refusals,
    stop_operator,
    two_worlds,
    wait_for,
)

pytestmark = pytest.mark.kube

REPO = Path(__file__).resolve().parents[2]
# The chart's memory limit for the operator (charts/multiworld-operator/values.yaml).
CHART_LIMIT_MIB = 256
TENANT = "tenant"


def _objects() -> bytes:
    """JSON of ten million empty objects (30 MiB; 30 KiB of gzip): 25 times that once parsed."""
    return b"[" + b"{}," * (10_000_000 - 1) + b"{}]"


def _deep() -> bytes:
    """JSON nested ten million arrays deep."""
    return b"[" * 10_000_000


@contextmanager
def operator_process(kubeconfig: Path, namespace: str, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`multiworld operator` serving `namespace` as a process of its own (its memory is its own)."""
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "multiworld_operator.cli", "operator", "--namespace", namespace],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KUBECONFIG": str(kubeconfig), ENV_CHANNEL_PORT: "0"},
            cwd=REPO,
        )
    try:
        yield process
    finally:
        stop_operator(process)


def peak_rss_mib(process: subprocess.Popen[bytes]) -> float:
    """The process's peak resident memory so far (the kernel's high-water mark)."""
    (line,) = [x for x in Path(f"/proc/{process.pid}/status").read_text().splitlines() if x.startswith("VmHWM:")]
    return int(line.split()[1]) / 1024


def tenant_api(cluster: Cluster, api: client.ApiClient, namespace: str) -> client.CoreV1Api:
    """A ServiceAccount of the namespace bound to the `edit` ClusterRole there: a tenant."""
    account = client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=TENANT))
    client.CoreV1Api(api).create_namespaced_service_account(namespace, account)
    binding = client.V1RoleBinding(
        metadata=client.V1ObjectMeta(name=TENANT),
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name="edit"),
        subjects=[client.RbacV1Subject(kind="ServiceAccount", name=TENANT, namespace=namespace)],
    )
    client.RbacAuthorizationV1Api(api).create_namespaced_role_binding(namespace, binding)
    return client.CoreV1Api(cluster.serviceaccount_api_client(namespace, TENANT))


@pytest.mark.parametrize("junk", [_objects, _deep], ids=["objects", "deep"])
def test_a_tenants_memory_configmap_costs_the_operator_a_bounded_amount(
    kube_cluster: Cluster, namespace: str, tmp_path: Path, junk: Callable[[], bytes]
) -> None:
    kubeconfig = cluster_release(kube_cluster).operator_kubeconfig
    log_path = tmp_path / "operator.log"
    with kube_cluster.api_client() as api, Kubelet(api, namespace) as kubelet:
        kube = KubeNamespace(api, namespace)
        tenant = tenant_api(kube_cluster, api, namespace)
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
