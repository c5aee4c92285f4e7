"""GPUs as the scheduler and the kubelet see them on the test nodes: each node's device plugin
(tests/cluster/device_plugin, started beside its kubelet) advertises 4 `nvidia.com/gpu`; a pod
asking for one is placed, admitted and given the ids in NVIDIA_VISIBLE_DEVICES and
CUDA_VISIBLE_DEVICES; a pod asking for more than any node has stays Pending with the scheduler's
reason; a powered-off node, healed, advertises them again (its plugin registered with the new
kubelet). Pods of our worker image on the session's nodes."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.cluster import Cluster
from tests.cluster.node import GPU_RESOURCE, GPUS_PER_NODE
from tests.support.node_support import WAIT_S, WORKER_IMAGE
from tests.support.operator_support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.node]

SHOW_DEVICES = ["sh", "-c", "echo NVIDIA=$NVIDIA_VISIBLE_DEVICES CUDA=$CUDA_VISIBLE_DEVICES"]


@pytest.fixture
def gpu_apps(kube_node: Cluster) -> Iterator[tuple[client.CoreV1Api, str]]:
    """A namespace of the test's own, deleted afterwards with its pods (their GPUs freed)."""
    name = f"gpus-{uuid.uuid4().hex[:8]}"
    with kube_node.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": name}})  # type: ignore[arg-type]  # a dict body, sent as is
        try:
            # Pods are admitted once the default ServiceAccount has its token.
            tokens = lambda: [a for a in core.list_namespaced_service_account(name).items if a.secrets]  # noqa: E731
            wait_for(f"a ServiceAccount token in {name}", tokens, WAIT_S)
            yield core, name
        finally:
            core.delete_namespace(name)


def _create(core: client.CoreV1Api, namespace: str, name: str, gpus: int, node: str | None = None) -> None:
    """A pod printing the devices it was given, asking for `gpus` GPUs (on `node`, when named,
    by a nodeSelector: the scheduler still counts the GPUs)."""
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {
                "name": "show",
                "image": WORKER_IMAGE,
                "imagePullPolicy": "Never",
                "command": SHOW_DEVICES,
                "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
            }
        ],
    }
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    core.create_namespaced_pod(namespace, {"metadata": {"name": name}, "spec": spec})  # type: ignore[arg-type]  # a dict body, sent as is


def _shown_devices(core: client.CoreV1Api, namespace: str, name: str) -> tuple[str, list[str]]:
    """The node the pod ran on and the device ids it saw (both variables the same)."""

    def succeeded() -> client.V1Pod | None:
        pod = core.read_namespaced_pod(name, namespace)
        assert pod.status.phase != "Failed", pod.status
        return pod if pod.status.phase == "Succeeded" else None

    node = wait_for(f"pod {name} Succeeded", succeeded, WAIT_S).spec.node_name
    logged = core.read_namespaced_pod_log(name, namespace).strip()
    match = re.fullmatch(r"NVIDIA=(\S*) CUDA=(\S*)", logged)
    assert match and match.group(1) == match.group(2), logged
    return node, match.group(1).split(",")


def test_each_node_advertises_four_gpus(kube_node: Cluster) -> None:
    with kube_node.api_client() as api:
        nodes = {n.metadata.name: n for n in client.CoreV1Api(api).list_node().items}
    for node in kube_node.nodes:
        status = nodes[node.name].status
        assert status.capacity.get(GPU_RESOURCE) == status.allocatable.get(GPU_RESOURCE) == str(GPUS_PER_NODE), (
            node.name,
            status.capacity,
        )


def test_a_pod_asking_for_gpus_runs_and_sees_their_ids(
    kube_node: Cluster, gpu_apps: tuple[client.CoreV1Api, str]
) -> None:
    core, namespace = gpu_apps
    _create(core, namespace, "one", 1)
    _create(core, namespace, "two", 2)
    one_node, one = _shown_devices(core, namespace, "one")
    two_node, two = _shown_devices(core, namespace, "two")
    ids = {str(i) for i in range(GPUS_PER_NODE)}
    assert len(one) == 1 and set(one) <= ids, one
    assert len(two) == 2 and set(two) <= ids and two == sorted(two), two
    assert {one_node, two_node} <= {node.name for node in kube_node.nodes}


def test_a_pod_asking_for_more_gpus_than_any_node_has_stays_pending(
    kube_node: Cluster, gpu_apps: tuple[client.CoreV1Api, str]
) -> None:
    core, namespace = gpu_apps
    _create(core, namespace, "greedy", GPUS_PER_NODE + 1)

    def unschedulable() -> client.V1PodCondition | None:
        pod = core.read_namespaced_pod("greedy", namespace)
        conditions = pod.status.conditions or []
        return next((c for c in conditions if c.type == "PodScheduled" and c.status == "False"), None)

    condition = wait_for("the scheduler's verdict on pod greedy", unschedulable, WAIT_S)
    assert condition.reason == "Unschedulable", condition
    assert f"Insufficient {GPU_RESOURCE}" in condition.message, condition.message
    assert f"0/{len(kube_node.nodes)} nodes are available" in condition.message, condition.message
    pod = core.read_namespaced_pod("greedy", namespace)
    assert pod.status.phase == "Pending" and not pod.spec.node_name, pod.status


@pytest.mark.node_fault
def test_a_healed_node_advertises_its_gpus_again(kube_node: Cluster, gpu_apps: tuple[client.CoreV1Api, str]) -> None:
    """Power-off kills the node's device plugin with its kubelet; heal starts both again and
    returns once the Node is Ready with its GPUs allocatable; a pod placed there gets one."""
    core, namespace = gpu_apps
    last = kube_node.nodes[-1].name
    try:
        kube_node.power_off(last)
    finally:
        kube_node.heal(last)
    allocatable = core.read_node(last).status.allocatable
    assert allocatable.get(GPU_RESOURCE) == str(GPUS_PER_NODE), allocatable
    _create(core, namespace, "after-heal", 1, node=last)
    node, devices = _shown_devices(core, namespace, "after-heal")
    assert node == last and len(devices) == 1, (node, devices)
