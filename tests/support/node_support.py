"""What the user journeys on the real node share: the chart installed with Helm running our
operator image, the example manifests pointed at our worker image, kubectl as a user types it,
and signals sent to a pod's process through the container runtime."""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from tests.cluster import cluster as cluster_module, images, operator_release
from tests.cluster.cluster import Cluster, ClusterError
from tests.support.operator_support import KubeNamespace, wait_for

REPO = Path(__file__).resolve().parents[2]
WORKER_IMAGE = "multiworld/worker:dev"
# Generous: two CPU cores run the control plane, the node and every pod.
WAIT_S = 180.0


@dataclass(frozen=True)
class Operator:
    """The chart's release: the operator's Deployment in `namespace`, workers in `apps`."""

    namespace: str
    fullname: str
    apps: str


@contextlib.contextmanager
def installed_operator(cluster: Cluster, node: str | None = None) -> Iterator[Operator]:
    """`helm install` of the chart with the operator image built from our Dockerfile, watching
    only a namespace of its own (where the worker ServiceAccount goes and MultiWorlds are
    applied), so that a bench's release and the tests' share the node; at the end `helm
    uninstall`, and both namespaces deleted with what was left in them (nothing of it runs on
    in the node through the tests that follow). One replica (with leader election, as the chart
    runs it): the journeys follow the operator's one pod; a standby's takeover is tested on the
    control plane (test_leadership.py). With `node`, the operator runs on that node only (a
    node-loss journey keeps it off the node it loses)."""
    suffix = uuid.uuid4().hex[:6]
    namespace, apps, release = f"multiworld-{suffix}", f"apps-{suffix}", f"mw-{suffix}"
    operator_release.install(
        cluster.kubeconfig, namespace, release, [apps], watch_only_those=True, replicas=1, node=node
    )
    try:
        yield Operator(namespace, f"{release}-multiworld-operator", apps)
    finally:
        operator_release.uninstall(cluster.kubeconfig, namespace, release)
        with cluster.api_client() as api:
            for name in (apps, namespace):
                client.CoreV1Api(api).delete_namespace(name)


def kubectl(cluster: Cluster, *args: str, check: bool = True) -> str:
    """Run the real kubectl (built from the same source as the node) as the admin."""
    binary = cluster_module.find_node_binaries().kubectl
    result = subprocess.run([str(binary), f"--kubeconfig={cluster.kubeconfig}", *args],
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr}")
    return result.stdout


def example_manifest(
    example: str,
    name: str,
    folder: Path,
    *,
    initial_delay: str = "0s",
    steps: int = 100000,
    interval: float = 0.5,
    spares: dict[str, int] | None = None,
    variant: str = "multiworld.yaml",
) -> Path:
    """examples/<example>/<variant> as committed, with our worker image (never pulled), its own
    name, a first restart with no delay (its failure policy kept otherwise), steps enough to
    outlast the test, and the warm spares given per member."""
    manifest: dict[str, Any] = yaml.safe_load((REPO / "examples" / example / variant).read_text())
    manifest["metadata"]["name"] = name
    spec = manifest["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    container["image"] = WORKER_IMAGE
    container["imagePullPolicy"] = "Never"
    container["args"] = ["--steps", str(steps), "--interval", str(interval)]
    for world in spec["worlds"]:
        world["failurePolicy"] = {**world.get("failurePolicy", {}), "maxRestarts": 20, "window": "1h",
                                  "backoff": {"initialDelay": initial_delay}}  # fmt: skip
    for member in spec["members"]:
        if member["name"] in (spares or {}):
            member["spares"] = (spares or {})[member["name"]]
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@contextlib.contextmanager
def applied(cluster: Cluster, operator: Operator, kube: KubeNamespace, path: Path, name: str) -> Iterator[None]:
    """The manifest at `path` applied for the block; then its MultiWorld deleted and its pods
    gone, so the next test has the node's cores."""
    kubectl(cluster, "apply", "-n", operator.apps, "-f", str(path))
    try:
        yield
    finally:
        kubectl(cluster, "delete", "mw", name, "-n", operator.apps, "--wait=false")
        wait_for(f"the pods of {name} gone", lambda: not kube.pods(name), WAIT_S)


def operator_pods(cluster: Cluster, operator: Operator) -> list[client.V1Pod]:
    """The release's operator pods not being deleted."""
    with cluster.api_client() as api:
        pods = (
            client.CoreV1Api(api)
            .list_namespaced_pod(operator.namespace, label_selector="app.kubernetes.io/name=multiworld-operator")
            .items
        )
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def ready_operator_pod(cluster: Cluster, operator: Operator) -> client.V1Pod | None:
    """The release's operator pod that runs and is Ready, if one is."""
    for pod in operator_pods(cluster, operator):
        statuses = pod.status.container_statuses or []
        if pod.status.phase == "Running" and statuses and all(s.ready for s in statuses):
            return pod
    return None


def wait_running(kube: KubeNamespace, name: str, epochs: dict[str, int]) -> dict[str, Any]:
    """The status once Running at `epochs`; on timeout, the error holds the last status seen."""
    seen: list[dict[str, Any]] = [{}]

    def running() -> dict[str, Any] | None:
        seen[0] = status = kube.status(name)
        worlds = status.get("worlds") or {}
        if status.get("phase") == "Running" and {w: s["epoch"] for w, s in worlds.items()} == epochs:
            return status
        return None

    try:
        return wait_for(f"MultiWorld {name} Running at epochs {epochs}", running, WAIT_S)
    except ClusterError as error:
        raise ClusterError(f"{error}; the last status: {json.dumps(seen[0])}") from None


def container_id(pod: client.V1Pod) -> str:
    """The containerd id of the pod's (only) container."""
    (status,) = pod.status.container_statuses
    runtime, _, identifier = status.container_id.partition("://")
    assert runtime == "containerd", status.container_id
    return identifier


def signal_container(cluster: Cluster, pod: client.V1Pod, signal: str) -> None:
    """Send `signal` to the container's main process through its node's containerd, as a crash
    or a debugger would: the API server hears of it only through the kubelet."""
    cluster.node_named(pod.spec.node_name).ctr(
        ["tasks", "kill", "--signal", signal, container_id(pod)], f"sending {signal} to {pod.metadata.name}"
    )


@contextlib.contextmanager
def bench_cluster(given: Path | None, nodes: int) -> Iterator[Cluster]:
    """A bench's cluster of `nodes` nodes with our images loaded: the running one in the folder
    `given` (`make cluster NODES=N`'s .cluster, or a test session's), or its own in a temp dir."""
    if given is not None:
        cluster = Cluster(given)
        if len(cluster.nodes) < nodes or "kubelet" not in cluster.running_components():
            raise SystemExit(
                f"--cluster {given}: this bench needs {nodes} running node(s) (`make cluster NODES={nodes}`)"
            )
        for node in cluster.nodes:
            images.load_images(str(node.socket))
        yield cluster
        return
    with tempfile.TemporaryDirectory(prefix="mw-bench-node-") as folder:
        cluster = Cluster(Path(folder))
        cluster.start(cluster_module.find_binaries(), detach=False, nodes=nodes)
        try:
            for node in cluster.nodes:
                images.load_images(str(node.socket))
            yield cluster
        finally:
            cluster.stop()
