"""A tenant and the operator it must not stop, for the tests that attack the operator through
what a tenant may write: `multiworld operator` as a process of its own (its memory its own),
its peak memory, a ServiceAccount with `edit` in one namespace only, and values nested as deep
as the API server stores."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes import client

from multiworld_operator.kube.client.nesting import API_MAX_DEPTH
from multiworld_operator.kube.workers.channel_settings import ENV_CHANNEL_PORT
from tests.cluster.cluster import Cluster
from tests.support.operator_support import GROUP, PLURAL, stop_operator

REPO = Path(__file__).resolve().parents[2]
# The chart's memory limit for the operator (charts/multiworld-operator/values.yaml).
CHART_LIMIT_MIB = 256
TENANT = "tenant"


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


def tenant_api(cluster: Cluster, api: client.ApiClient, namespace: str) -> client.ApiClient:
    """The API as a tenant: a ServiceAccount of the namespace bound there to the `edit`
    ClusterRole and to a Role on its MultiWorlds and their status (which the chart leaves to
    the cluster's admin to grant)."""
    rbac = client.RbacAuthorizationV1Api(api)
    account = client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=TENANT))
    client.CoreV1Api(api).create_namespaced_service_account(namespace, account)
    multiworlds = client.V1Role(
        metadata=client.V1ObjectMeta(name=TENANT),
        rules=[client.V1PolicyRule(api_groups=[GROUP], resources=[PLURAL, f"{PLURAL}/status"], verbs=["*"])],
    )
    rbac.create_namespaced_role(namespace, multiworlds)
    for kind, role in (("ClusterRole", "edit"), ("Role", TENANT)):
        binding = client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name=f"{TENANT}-{role}"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind=kind, name=role),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name=TENANT, namespace=namespace)],
        )
        rbac.create_namespaced_role_binding(namespace, binding)
    return cluster.serviceaccount_api_client(namespace, TENANT)


def nested(depth: int) -> list[Any]:
    """[[[...[1]...]]], `depth` lists deep (built without recursion)."""
    value: list[Any] = [1]
    for _ in range(depth - 1):
        value = [value]
    return value


@contextmanager
def deep_enough() -> Iterator[None]:
    """This process may encode and decode what it sends (the client's JSON, both ways)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 3 * API_MAX_DEPTH)
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)
