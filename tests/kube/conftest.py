"""Fixtures for tests that need a real Kubernetes API server.

`kube_cluster` (session): a fresh etcd + kube-apiserver + kube-controller-manager in a temp dir.
`kube_node` (session): the same with SESSION_NODES real nodes (tests/cluster/node.py) holding our
images.
`operator` (module): the chart on the node, its operator pod Ready; `kube`: its apps namespace.
`namespace` (function): a fresh namespace, deleted afterwards.
`scene` (function): the operator serving `namespace` (see tests/support/operator_support.py).
A missing control plane is a test error with the reason, never a skip.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Generator, Iterator

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.cluster import cluster as cluster_module, images as images_module
from tests.cluster.cluster import Cluster
from tests.support.node_support import WAIT_S, Operator, installed_operator, kubectl, ready_operator_pod

# The operator tests' `scene` fixture, for every test here (not imported by each test module, where
# its parameters would shadow it).
from tests.support.operator_support import (
    KubeNamespace,
    scene,  # noqa: F401
    wait_for,
)

DEFAULT_SERVICEACCOUNT_TIMEOUT_S = 60.0
# The operator's log lines a failed node test shows (a failure in CI leaves nothing else behind).
FAILURE_LOG_LINES = 120
# The node journeys run on two nodes: worlds span them, and a node can be lost.
SESSION_NODES = 2


def _running_cluster(tmp_path_factory: pytest.TempPathFactory, nodes: int) -> Iterator[Cluster]:
    """A cluster started for the session (with `nodes` real nodes, holding our images), stopped
    afterwards. A missing part is a test error that says why."""
    cluster = Cluster(tmp_path_factory.mktemp("kube-node" if nodes else "kube-cluster"))
    failure = ""
    try:
        cluster.start(cluster_module.find_binaries(), detach=False, nodes=nodes)
        for node in cluster.nodes:
            images_module.load_images(str(node.socket))
    except (cluster_module.ClusterError, images_module.ImageError) as error:
        cluster.stop()
        failure = f"the test Kubernetes {'node' if nodes else 'control plane'} is unavailable: {error}"
    except BaseException:  # a timeout or an interrupt: nothing of the cluster may outlive it
        cluster.stop()
        raise
    if failure:
        pytest.fail(failure, pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A running control plane; `.kubeconfig`, `.api_client()`, `.serviceaccount_kubeconfig(ns, name)`."""
    yield from _running_cluster(tmp_path_factory, nodes=0)


@pytest.fixture
def namespace(kube_cluster: Cluster) -> Iterator[str]:
    """A fresh namespace whose `default` ServiceAccount exists (so Pods are admitted)."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    with kube_cluster.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        if kube_cluster.has_controller_manager:

            def default_serviceaccount() -> client.V1ServiceAccount | None:
                kube_cluster.check_alive()
                return _find_serviceaccount(core, name, "default")

            cluster_module.wait_for(
                f"the default ServiceAccount in namespace {name} (made by kube-controller-manager)",
                default_serviceaccount,
                DEFAULT_SERVICEACCOUNT_TIMEOUT_S,
            )
        try:
            yield name
        finally:
            try:
                core.delete_namespace(name)
            except ApiException as error:
                if error.status != 404:
                    raise


def _find_serviceaccount(core: client.CoreV1Api, namespace: str, name: str) -> client.V1ServiceAccount | None:
    try:
        return core.read_namespaced_service_account(name, namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


@pytest.fixture(scope="session")
def kube_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane with SESSION_NODES real nodes (each a kubelet, containerd and kube-proxy in
    namespaces of its own, with its own pod network; cluster DNS) whose runtimes hold our images,
    multiworld/operator:dev and multiworld/worker:dev. `make test` builds the images first
    (minutes when cold); here they are only loaded (into a new node's image store: a minute or
    two, once)."""
    yield from _running_cluster(tmp_path_factory, nodes=SESSION_NODES)


@pytest.fixture(scope="module")
def operator(kube_node: Cluster) -> Iterator[Operator]:
    """The chart installed on the node for the module's tests (node_support.installed_operator),
    its one operator pod Ready; a module may install its own instead."""
    with installed_operator(kube_node) as installed:
        wait_for("the operator's pod Running and Ready", lambda: ready_operator_pod(kube_node, installed), WAIT_S)
        yield installed


@pytest.fixture
def kube(kube_node: Cluster, operator: Operator) -> Iterator[KubeNamespace]:
    """The operator's apps namespace, where the node tests apply their MultiWorlds."""
    with kube_node.api_client() as api:
        yield KubeNamespace(api, operator.apps)


@pytest.fixture
def stage(record_property: Callable[[str, object], None]) -> Callable[[str], None]:
    """`stage(name)` records the seconds since the test's start or its last stage as the property
    `stage_<name>_s` of the test's JUnit report (`--junitxml`): where a slow run of a long
    journey spent its time, without its output."""
    last = [time.monotonic()]

    def record(name: str) -> None:
        now = time.monotonic()
        record_property(f"stage_{name}_s", round(now - last[0], 2))
        last[0] = now

    return record


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A node test that fails shows, beside its traceback, its operator's latest log lines and
    what its MultiWorlds and pods were then: a failure seen only in CI can then be read."""
    report = yield
    funcargs = getattr(item, "funcargs", {})
    cluster, operator = funcargs.get("kube_node"), funcargs.get("operator")
    if report.failed and call.when == "call" and isinstance(operator, Operator) and isinstance(cluster, Cluster):
        logs = ("logs", "-n", operator.namespace, "-l", "app.kubernetes.io/name=multiworld-operator", "--prefix",
                f"--tail={FAILURE_LOG_LINES}", "--timestamps")  # fmt: skip
        for title, args in (
            ("operator log", logs),
            ("the operator's log before its last restart", (*logs, "--previous")),
            ("the operator's pods and how their containers last ended", ("get", "pods", "-n", operator.namespace,
             "-o", "custom-columns=NAME:.metadata.name,RESTARTS:.status.containerStatuses[*].restartCount,"
             "LAST:.status.containerStatuses[*].lastState")),
            ("the operator's Events", ("get", "events", "-n", operator.namespace)),
            ("MultiWorlds and pods", ("get", "mw,pods", "-n", operator.apps, "-o", "wide")),
        ):  # fmt: skip
            report.sections.append((title, kubectl(cluster, *args, check=False)))
    return report
