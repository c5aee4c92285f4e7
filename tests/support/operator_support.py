"""What the operator tests share: the chart's RBAC installed for real, the operator under
KopfRunner as the chart's ServiceAccount, a stand-in kubelet, MultiWorld manifests and reads.

There is no kubelet in the test cluster, so `Kubelet` does its part through the API: it marks
new pods Running (patching their status, as a kubelet would) and fails them on request.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Set
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import helm_python as helm
import pytest
from kopf.testing import KopfRunner
from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.config import kube_config

from multiworld.contract import NAME_LABEL
from multiworld_operator.kube.client.api_basics import MERGE_PATCH
from multiworld_operator.kube.leadership import LEADER_LABEL
from multiworld_operator.kube.memory.planner_memory import read_memory
from multiworld_operator.kube.objects.bodies import CREATED_FOR_ANNOTATION
from multiworld_operator.kube.workers.channel_settings import ENV_CHANNEL_PORT
from tests.cluster import cluster as cluster_module
from tests.cluster.cluster import Cluster
from tests.support.webhook_support import RefusingWebhook

T = TypeVar("T")

CHART_DIR = Path(__file__).resolve().parents[2] / "charts" / "multiworld-operator"
WORKER_SA = "multiworld-worker"
GROUP, VERSION, PLURAL = "multiworld.io", "v1alpha1", "multiworlds"

HELM_TIMEOUT_S = 120
# Generous: two CPU cores are shared with other work; nothing here asserts a speed.
WAIT_S = 90.0
KUBELET_TICK_S = 0.2


@dataclass(frozen=True)
class Release:
    """A helm release of the chart; the operator's ServiceAccount token in a kubeconfig."""

    namespace: str
    fullname: str
    operator_kubeconfig: Path


def install_release(cluster: Cluster, namespace: str, values: dict[str, Any]) -> Release:
    release = f"mw-{uuid.uuid4().hex[:6]}"
    fullname = f"{release}-multiworld-operator"
    with helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=namespace) as config:
        installed = config.install(CHART_DIR, release, values, timeout=HELM_TIMEOUT_S)
    assert installed["status"] == "deployed", installed
    return Release(namespace, fullname, cluster.serviceaccount_kubeconfig(namespace, fullname))


_releases: dict[Path, Release] = {}
# For an operator run here (in-process, or a process of the benches) without the admission
# webhook, which test_admission.py covers: watching every namespace, a configuration calling a
# Service nobody serves would refuse every MultiWorld (failurePolicy Fail).
WITHOUT_WEBHOOK: dict[str, Any] = {"webhook": {"enabled": False}}


def cluster_release(cluster: Cluster) -> Release:
    """The chart installed once per test cluster, watching every namespace (its ClusterRole)."""
    if cluster.directory not in _releases:
        namespace = f"mw-system-{uuid.uuid4().hex[:6]}"
        with cluster.api_client() as api:
            client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
        _releases[cluster.directory] = install_release(cluster, namespace, WITHOUT_WEBHOOK)
    return _releases[cluster.directory]


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = WAIT_S) -> T:
    return cluster_module.wait_for(what, probe, timeout)


@contextmanager
def running_operator(kubeconfig: Path, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[KopfRunner]:
    """The operator (kopf, standalone) serving `namespace` with the credentials in `kubeconfig`
    only. The kubernetes client reads $KUBECONFIG once, at import, so its default is pointed
    there too. On exit: no request of the operator was forbidden (the chart grants enough)."""
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    # The worker channel on any free port (its pods are told which).
    monkeypatch.setenv(ENV_CHANNEL_PORT, "0")
    args = ["run", "--standalone", "--namespace", namespace, "-m", "multiworld_operator.kube.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        yield runner
    assert runner.exit_code == 0, runner.output
    assert not refusals(runner.output), runner.output


# How a refused request shows in the operator's log: the API server's answer, or kopf's own
# words when it lacks a permission it checks for at start (CRDs, namespaces).
REFUSAL_MARKS = ("forbidden", " 403", "not enough permissions")


# Not a refusal of the operator's rights: an earlier test's namespace is still being deleted.
TERMINATING = "because it is being terminated"
# Nor are the faults tests make on purpose: a full ResourceQuota (a 403), an immutable object (a
# 422 whose causes read "Forbidden"), a write the tests' own admission webhook refuses (a 403).
INTENDED_FAULTS = ("exceeded quota", "field is immutable", RefusingWebhook.MESSAGE)


def refusals(log: str) -> list[str]:
    """The lines of an operator log that show a refused request."""
    return [
        line
        for line in log.splitlines()
        if any(mark in line.lower() for mark in REFUSAL_MARKS)
        and TERMINATING not in line
        and not any(fault in line for fault in INTENDED_FAULTS)
    ]


class Kubelet:
    """Plays the kubelet for one namespace through the pods' status: pods appear Pending and
    are marked Running (unless `hold` is set); `fail(pod)` marks one Failed."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.hold = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kubelet {namespace}", daemon=True)

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(KUBELET_TICK_S):
            if self.hold.is_set():
                continue
            for pod in self.core.list_namespaced_pod(self.namespace).items:
                if pod.status.phase == "Pending" and pod.metadata.deletion_timestamp is None:
                    self.set_phase(pod.metadata.name, "Running")

    def set_phase(self, pod: str, phase: str) -> None:
        try:
            self.core.patch_namespaced_pod_status(
                pod, self.namespace, {"status": {"phase": phase}}, _content_type=MERGE_PATCH
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def fail(self, pod: str) -> None:
        self.set_phase(pod, "Failed")


# -- replicas with leader election -----------------------------------------------------------


REPLICA_STOP_S = 30.0


def stop_operator(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as Kubernetes stops a pod; SIGKILL if it has not exited within REPLICA_STOP_S."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(REPLICA_STOP_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class OperatorReplica:
    """`multiworld operator --leader-election` as a process of its own, playing one replica of
    the chart's Deployment: the chart's ServiceAccount, and POD_NAME/POD_NAMESPACE naming a
    stand-in pod `name` in the release's namespace (no kubelet runs it; it only carries the
    leader label). Its identity on the Lease is `name`."""

    def __init__(
        self,
        api: client.ApiClient,
        release: Release,
        namespace: str,
        lease: str,
        name: str,
        log_path: Path,
        duration_s: int,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.release = release
        self.name = name
        self.log_path = log_path
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1PodSpec(containers=[client.V1Container(name="operator", image="stand-in")]),
        )
        # The release namespace's default ServiceAccount may still be on its way.
        wait_for(f"stand-in pod {name}", lambda: _created(self.core, release.namespace, pod))
        args = ["--namespace", namespace, "--leader-election", "--lease-namespace", release.namespace]
        args += ["--lease-name", lease, "--lease-duration", str(duration_s)]
        env = {
            "KUBECONFIG": str(release.operator_kubeconfig),
            "POD_NAME": name,
            "POD_NAMESPACE": release.namespace,
            ENV_CHANNEL_PORT: "0",  # replicas on one host: each its own worker channel port
        }
        with open(log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "multiworld_operator.cli", "-v", "operator", *args],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = REPLICA_STOP_S) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Ended (SIGKILL if it still runs: a test that wanted it stopped stopped it), and its pod gone."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            self.core.delete_namespaced_pod(self.name, self.release.namespace, grace_period_seconds=0)
        except ApiException as error:
            if error.status != 404:
                raise


def _created(core: client.CoreV1Api, namespace: str, body: client.V1Pod) -> bool:
    try:
        core.create_namespaced_pod(namespace, body)
    except ApiException as error:
        if error.status == 403 and "serviceaccount" in str(error.body).lower():
            return False
        raise
    return True


def lease_holder(api: client.ApiClient, namespace: str, name: str) -> str | None:
    """Who holds the Lease; None when nobody does (or it does not exist yet)."""
    try:
        lease = client.CoordinationV1Api(api).read_namespaced_lease(name, namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return lease.spec.holder_identity or None


def leader_labelled(api: client.ApiClient, namespace: str) -> set[str]:
    """The pods of `namespace` that carry the leader label."""
    listing = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=f"{LEADER_LABEL}=true")
    return {pod.metadata.name for pod in listing.items}


# -- manifests -------------------------------------------------------------------------------


def manifest(
    name: str,
    members: dict[str, int],
    worlds: dict[str, list[str]],
    policy: dict[str, Any] | None = None,
    template: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A MultiWorld: members by replicas, worlds by ranks, one failure policy for every world."""
    world_specs = []
    for world, ranks in worlds.items():
        spec: dict[str, Any] = {"name": world, "ranks": ranks}
        if policy is not None:
            spec["failurePolicy"] = policy
        world_specs.append(spec)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "MultiWorld",
        "metadata": {"name": name},
        "spec": {
            "template": template or {"spec": {"containers": [{"name": "worker", "image": "multiworld/worker:test"}]}},
            "members": [{"name": m, "replicas": r} for m, r in members.items()],
            "worlds": world_specs,
        },
    }


# The seed topology: a leader shared by two worlds, each with two exclusive workers.
# The pods of two_worlds() under its default name.
TWO_WORLDS_PODS = frozenset({"mw-leader-0", "mw-a-0", "mw-a-1", "mw-b-0", "mw-b-1"})


def two_worlds(name: str = "mw", policy: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    return manifest(
        name, {"leader": 1, "a": 2, "b": 2}, {"wa": ["leader", "a"], "wb": ["leader", "b"]}, policy, **kwargs
    )


# -- reads -----------------------------------------------------------------------------------


class KubeNamespace:
    """Reads and writes of one namespace as the admin."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    # The custom objects API returns the object as JSON (its annotations say `object`).
    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        created = self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)
        return cast("dict[str, Any]", created)

    def get(self, name: str = "mw") -> dict[str, Any]:
        return cast(
            "dict[str, Any]", self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        )

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, {"spec": spec}, _content_type=MERGE_PATCH
        )

    def delete(self, name: str = "mw") -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def status(self, name: str = "mw") -> dict[str, Any]:
        return self.get(name).get("status") or {}

    def table(self, name: str = "mw") -> dict[str, dict[str, Any]]:
        """The world table as the operator published it to the workers: world -> its entry, from
        the operator's memory (stored before the table goes out)."""
        try:
            found = self.core.read_namespaced_config_map(name, self.namespace)
        except ApiException as error:
            if error.status == 404:
                return {}
            raise
        memory = read_memory({"binaryData": found.binary_data}) or {}
        return {entry["name"]: entry for entry in (memory.get("table") or {}).get("worlds") or []}

    def network_policy(self, name: str = "mw") -> client.V1NetworkPolicy | None:
        """The NetworkPolicy `name`, None when there is none."""
        try:
            return client.NetworkingV1Api(self.api).read_namespaced_network_policy(name, self.namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def pods(self, name: str = "mw") -> dict[str, client.V1Pod]:
        listing = self.core.list_namespaced_pod(self.namespace, label_selector=f"{NAME_LABEL}={name}")
        return {p.metadata.name: p for p in listing.items if p.metadata.deletion_timestamp is None}

    def uids(self, name: str = "mw") -> dict[str, str]:
        return {n: p.metadata.uid for n, p in self.pods(name).items()}

    def events(self, name: str = "mw") -> list[client.CoreV1Event]:
        """The MultiWorld's own Events (its Service has the same name; the endpoint controllers post on that)."""
        selector = f"involvedObject.name={name},involvedObject.kind=MultiWorld"
        return self.core.list_namespaced_event(self.namespace, field_selector=selector).items

    def event_reasons(self, name: str = "mw") -> list[str]:
        return [e.reason for e in self.events(name)]

    def annotate(self, pod: str, annotations: dict[str, str]) -> None:
        self.core.patch_namespaced_pod(
            pod, self.namespace, {"metadata": {"annotations": annotations}}, _content_type=MERGE_PATCH
        )

    # -- waits -------------------------------------------------------------------------------

    def wait_running(self, name: str = "mw", *, epochs: dict[str, int] | None = None) -> dict[str, Any]:
        """Until the MultiWorld is Running with every world whole (at `epochs`, when given)."""

        def running() -> dict[str, Any] | None:
            status = self.status(name)
            worlds = status.get("worlds") or {}
            if status.get("phase") != "Running":
                return None
            if epochs is not None and {w: s["epoch"] for w, s in worlds.items()} != epochs:
                return None
            return status

        return wait_for(f"MultiWorld {self.namespace}/{name} Running at epochs {epochs}", running)

    def wait_world(
        self, world: str, predicate: Callable[[dict[str, Any]], bool], what: str, name: str = "mw"
    ) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            status = self.status(name)
            state = (status.get("worlds") or {}).get(world)
            return status if state is not None and predicate(state) else None

        return wait_for(f"world {world} of {self.namespace}/{name}: {what}", probe)

    def wait_pods(self, names: Set[str], name: str = "mw") -> dict[str, client.V1Pod]:
        def exactly() -> dict[str, client.V1Pod] | None:
            pods = self.pods(name)
            return pods if set(pods) == names else None

        # An empty set is falsy, so waiting for no pod at all waits for a True instead.
        if not names:
            wait_for("no pod left", lambda: not self.pods(name))
            return {}
        return wait_for(f"exactly pods {sorted(names)}", exactly)


@dataclass
class Scene:
    """A test's namespace with the kubelet stand-in and the operator serving it."""

    cluster: Cluster
    kube: KubeNamespace
    kubelet: Kubelet
    runner: KopfRunner


@pytest.fixture
def scene(kube_cluster: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Scene]:
    """The operator runs as the chart's ServiceAccount (cluster-wide mode), serving `namespace`."""
    release = cluster_release(kube_cluster)
    with (
        kube_cluster.api_client() as api,
        Kubelet(api, namespace) as kubelet,
        running_operator(release.operator_kubeconfig, namespace, monkeypatch) as runner,
    ):
        yield Scene(kube_cluster, KubeNamespace(api, namespace), kubelet, runner)


def created_for(pod: client.V1Pod) -> dict[str, int]:
    return json.loads(pod.metadata.annotations[CREATED_FOR_ANNOTATION])


def env_of(pod: client.V1Pod) -> dict[str, str]:
    (container,) = pod.spec.containers
    return {e.name: e.value for e in container.env or []}


def printer_columns(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    """What `kubectl get mw NAME` prints: the API server's Table rendering of the CRD's
    additionalPrinterColumns, as {column name: cell}."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    request = api.param_serialize(
        "GET",
        path,
        header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*request)
    response.read()
    table = json.loads(response.data)
    (row,) = table["rows"]
    return {column["name"]: cell for column, cell in zip(table["columnDefinitions"], row["cells"], strict=True)}
