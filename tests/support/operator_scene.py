"""What the operator benches share: their own control plane (etcd, kube-apiserver,
kube-controller-manager; tests/cluster/cluster.py) in a temp dir, the chart installed for real
(CRD and RBAC, cluster-wide), `multiworld operator` as a process of its own, and a stand-in
kubelet (kubelet_stand_in.py) that marks pods Running and Failed through their status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.cluster import cluster as cluster_module
from tests.support import bench_common as common, operator_support as support
from tests.support.kubelet_stand_in import StandInKubelet

T = TypeVar("T")

GROUP, VERSION, PLURAL = support.GROUP, support.VERSION, support.PLURAL
# Generous: thousands of pods and a large status on two shared cores.
WAIT_S = 600.0
OPERATOR_STOP_S = 30.0
# Every failure restarts at once: no backoff, a budget no bench run exhausts.
POLICY = {"maxRestarts": 10000, "window": "1h", "backoff": {"initialDelay": "0s", "maxDelay": "0s"}}


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = WAIT_S) -> T:
    return cluster_module.wait_for(what, probe, timeout)


def star(name: str, worlds: int, policy: dict[str, Any] | None = POLICY) -> dict[str, Any]:
    """A leader shared by `worlds` worlds w<i>, each with one exclusive pod m<i>-0 and the
    failure policy `policy` (None: the default one)."""
    members = {"leader": 1, **{f"m{i}": 1 for i in range(worlds)}}
    return support.manifest(name, members, {f"w{i}": ["leader", f"m{i}"] for i in range(worlds)}, policy)


class OperatorProcess:
    """`multiworld operator` serving one namespace with the credentials of `kubeconfig`, with
    `flags` of its command line besides."""

    def __init__(self, kubeconfig: Path, namespace: str, log_path: Path, flags: Sequence[str] = ()) -> None:
        self.kubeconfig, self.namespace, self.log_path, self.flags = kubeconfig, namespace, log_path, list(flags)
        log_path.write_bytes(b"")
        self.proc = self._launch()

    def _launch(self) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "multiworld_operator.cli", "operator", "--namespace", self.namespace]
        with open(self.log_path, "ab") as log_file:
            return subprocess.Popen(
                [*command, *self.flags],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
                cwd=common.REPO,
            )

    def restart(self) -> None:
        """Stopped (SIGTERM, as Kubernetes would) and started again: a new process, its log
        appended to the same file."""
        self.stop()
        self.proc = self._launch()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise cluster_module.ClusterError(f"the operator exited ({self.proc.returncode}):\n{self.log()[-3000:]}")

    def peak_rss_mib(self) -> float:
        """The operator's peak resident memory so far (the kernel's high-water mark)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise cluster_module.ClusterError("the operator's /proc status has no VmHWM")

    def stop(self) -> None:
        """SIGTERM, as Kubernetes would; then its log must show no refused request."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(OPERATOR_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if "forbidden" in self.log().lower():
            raise cluster_module.ClusterError(f"the operator was refused a request:\n{self.log()[-3000:]}")


@dataclass
class Scene:
    api: client.ApiClient
    kube: Any  # operator_support.KubeNamespace
    kubelet: StandInKubelet
    operator: OperatorProcess
    credentials: str
    loaded: str
    # Where the operator serves its metrics (over TLS) and liveness endpoint (0: not served).
    metrics_port: int = 0
    liveness_port: int = 0
    epochs: dict[str, dict[str, int]] = field(default_factory=dict)


def new_namespace(cluster: Any, api: client.ApiClient, prefix: str) -> str:
    """A namespace whose default ServiceAccount exists (made by the controller-manager), so pods are admitted."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))

    def default_account() -> bool:
        cluster.check_alive()
        try:
            core.read_namespaced_service_account("default", name)
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    wait_for(f"the default ServiceAccount of namespace {name}", default_account)
    return name


def operator_credentials(cluster: Any, api: client.ApiClient, kind: str) -> tuple[Path, str]:
    """The chart installed for real; the kubeconfig the operator runs with, and what it is."""
    release = support.install_release(cluster, new_namespace(cluster, api, "mw-system"), support.WITHOUT_WEBHOOK)
    if kind == "admin":
        return cluster.kubeconfig, "the cluster admin (system:masters)"
    return release.operator_kubeconfig, (
        f"the chart's ServiceAccount {release.namespace}/{release.fullname} (its cluster-wide ClusterRole)"
    )


@contextmanager
def scene(directory: Path, credentials: str, endpoints: bool = False) -> Iterator[Scene]:
    """A control plane, the chart, a namespace served by the operator, the stand-in kubelet; with
    `endpoints`, the operator serves its metrics and liveness endpoint too, on ports picked once
    the control plane listens on its own."""
    try:
        binaries = cluster_module.find_binaries()
    except cluster_module.ClusterError as error:
        raise cluster_module.ClusterError(f"{error}\n(`make kube-binaries` builds the control plane)") from error
    cluster = cluster_module.Cluster(directory / "cluster")
    cluster.start(binaries, detach=False)
    try:
        with cluster.api_client() as api:
            kubeconfig, described = operator_credentials(cluster, api, credentials)
            namespace = new_namespace(cluster, api, "bench")
            loaded = common.machine_load()
            # Two ports, distinct, that no kernel-picked port takes meanwhile.
            metrics_port, liveness_port = common.free_ports(2) if endpoints else (0, 0)
            flags = ["--metrics-port", str(metrics_port), "--liveness", f"http://127.0.0.1:{liveness_port}/healthz"]
            operator = OperatorProcess(kubeconfig, namespace, directory / "operator.log", flags if endpoints else ())
            try:
                with StandInKubelet(api, namespace) as kubelet:
                    kube = support.KubeNamespace(api, namespace)
                    yield Scene(api, kube, kubelet, operator, described, loaded, metrics_port, liveness_port)
            finally:
                operator.stop()
    finally:
        cluster.stop()


def start(scene: Scene, name: str, worlds: int, policy: dict[str, Any] | None = POLICY) -> float:
    """Create the star MultiWorld `name`; return once every world is Running and its WorldReady
    Event is out. Returns the seconds from the create call until the last pod exists (seen
    through the stand-in kubelet's watch)."""
    pods = {f"{name}-leader-0", *(f"{name}-m{i}-0" for i in range(worlds))}
    since = scene.kubelet.mark()
    created_at = time.monotonic()
    scene.kube.create(star(name, worlds, policy))
    try:
        last = scene.kubelet.wait_all_appeared(pods, since, WAIT_S)
    except TimeoutError:
        scene.operator.check_alive()  # an operator that exited says why
        raise
    scene.epochs[name] = {f"w{i}": 1 for i in range(worlds)}

    def running() -> bool:
        scene.operator.check_alive()
        status = scene.kube.status(name)
        return (
            status.get("phase") == "Running"
            and {w: s["epoch"] for w, s in (status.get("worlds") or {}).items()} == scene.epochs[name]
        )

    wait_for(f"MultiWorld {name} Running with {worlds} worlds at epoch 1", running)
    wait_for(
        f"a WorldReady Event per world of {name}", lambda: scene.kube.event_reasons(name).count("WorldReady") == worlds
    )
    return last - created_at


def fail_and_recover(scene: Scene, name: str, index: int) -> float:
    """Fail world w<index>'s exclusive pod; return once the world is back at its next epoch
    with its WorldRecovered Event out. Returns react: from just before the status patch that
    marks the pod Failed to its replacement (stamped with the new epoch) seen by a watch."""
    world, pod = f"w{index}", f"{name}-m{index}-0"
    epoch = scene.epochs[name][world] + 1
    recovered = scene.kube.event_reasons(name).count("WorldRecovered")
    since = scene.kubelet.mark()

    failed_at = time.monotonic()
    scene.kubelet.fail(pod)
    replacement = scene.kubelet.wait_appeared(pod, {world: epoch}, since, WAIT_S)

    def back() -> bool:
        scene.operator.check_alive()
        state = (scene.kube.status(name).get("worlds") or {}).get(world) or {}
        return state.get("epoch") == epoch and state.get("phase") == "Running"

    wait_for(f"world {world} of {name} Running at epoch {epoch}", back)
    wait_for(
        f"the WorldRecovered Event of {world}",
        lambda: scene.kube.event_reasons(name).count("WorldRecovered") > recovered,
    )
    scene.epochs[name][world] = epoch
    return replacement.at - failed_at
