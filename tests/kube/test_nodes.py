"""Several real nodes and the faults a fleet meets (tests/cluster: power-off, partition, heal):
a pod reaches a pod on another node by its pod IP, a partitioned peer is silence (no reset) until
healed, and a powered-off node goes NotReady while its pods stay Running in the API. Real pods of
our worker image on the session's nodes; a node faulted here is healed before the test ends."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.cluster import cluster as cluster_module
from tests.cluster.cluster import Cluster
from tests.support.node_support import WAIT_S, WORKER_IMAGE
from tests.support.operator_support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.node]

PORT = 9999
# An echo server: one line per connection it accepts, naming the peer's address.
ECHO = f"""
import socket
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", {PORT}))
server.listen()
while True:
    peer, address = server.accept()
    print("from", address[0], flush=True)
    while data := peer.recv(100):
        peer.sendall(data)
"""
# A client driven over stdin, one command a line: `connect IP`, then `echo TIMEOUT` (send a byte
# and wait at most TIMEOUT seconds for it back). Each answer is one JSON line on stdout.
CLIENT = f"""
import json, socket, sys, time
connection = None
for line in sys.stdin:
    command, argument = line.split()
    started = time.monotonic()
    try:
        if command == "connect":
            connection = socket.create_connection((argument, {PORT}), timeout=10)
            answer = {{"ok": True}}
        else:
            connection.settimeout(float(argument))
            connection.sendall(b"x")
            answer = {{"ok": connection.recv(1) == b"x"}}
    except OSError as error:
        answer = {{"ok": False, "error": type(error).__name__, "errno": error.errno}}
    answer["seconds"] = round(time.monotonic() - started, 2)
    print(json.dumps(answer), flush=True)
"""


@pytest.fixture
def apps(kube_node: Cluster) -> Iterator[tuple[client.CoreV1Api, str]]:
    """A namespace of the test's own (deleted afterwards, with its pods) and the API to use it."""
    if len(kube_node.nodes) < 2:
        pytest.fail(f"the session cluster runs {len(kube_node.nodes)} node; these tests need two", pytrace=False)
    name = f"nodes-{uuid.uuid4().hex[:8]}"
    with kube_node.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        wait_for(
            "the default ServiceAccount's token (pods are admitted with it)",
            lambda: any(account.secrets for account in core.list_namespaced_service_account(name).items),
            WAIT_S,
        )
        try:
            yield core, name
        finally:
            core.delete_namespace(name)


def _run_pod(core: client.CoreV1Api, namespace: str, name: str, node: str, command: list[str]) -> client.V1Pod:
    """A pod of the worker image placed on `node` (by name, as the scheduler would), Running."""
    body: dict[str, Any] = {
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": name, "image": WORKER_IMAGE, "imagePullPolicy": "Never", "command": command}],
        },
    }
    core.create_namespaced_pod(namespace, body)  # type: ignore[arg-type]  # a dict body, sent as is

    def running() -> client.V1Pod | None:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase == "Running" and pod.status.pod_ip else None

    return wait_for(f"pod {name} Running on {node}", running, WAIT_S)


class Client:
    """CLIENT running in a pod (`kubectl exec -i`), one command at a time."""

    def __init__(self, cluster: Cluster, namespace: str, pod: str) -> None:
        kubectl = cluster_module.find_node_binaries().kubectl
        self.process = subprocess.Popen(
            [str(kubectl), f"--kubeconfig={cluster.kubeconfig}", "exec", "-i", "-n", namespace, pod, "--",
             "python", "-u", "-c", CLIENT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            said = self.process.stderr.read() if self.process.stderr else ""
            raise AssertionError(f"the client pod said nothing to {command!r}: {said}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextlib.contextmanager
def _client(cluster: Cluster, namespace: str, pod: str) -> Iterator[Client]:
    driven = Client(cluster, namespace, pod)
    try:
        yield driven
    finally:
        driven.close()


@contextlib.contextmanager
def _faulted(cluster: Cluster, node: str) -> Iterator[None]:
    """The block faults `node` as it likes; the node is healed (and Ready) afterwards whatever
    happens, so the session's later tests find every node up."""
    try:
        yield
    finally:
        cluster.heal(node)


def _echo_pair(cluster: Cluster, core: client.CoreV1Api, namespace: str) -> tuple[client.V1Pod, client.V1Pod]:
    """An echo server on the second node and an idle client pod on the first."""
    first, second = cluster.nodes[0].name, cluster.nodes[1].name
    server = _run_pod(core, namespace, "server", second, ["python", "-u", "-c", ECHO])
    idle = _run_pod(core, namespace, "client", first, ["sleep", "infinity"])
    return server, idle


def test_nodes_are_ready_with_their_own_addresses_and_pod_networks(kube_node: Cluster) -> None:
    with kube_node.api_client() as api:
        nodes = {n.metadata.name: n for n in client.CoreV1Api(api).list_node().items}
    assert sorted(nodes) == sorted(node.name for node in kube_node.nodes)
    for node in kube_node.nodes:
        shown = nodes[node.name]
        assert {a.type: a.address for a in shown.status.addresses}["InternalIP"] == node.ip
        assert any(c.type == "Ready" and c.status == "True" for c in shown.status.conditions)
    assert (
        len({node.ip for node in kube_node.nodes})
        == len({node.pod_subnet for node in kube_node.nodes})
        == len(kube_node.nodes)
    )


def test_a_pod_reaches_a_pod_on_another_node_by_its_pod_ip(
    kube_node: Cluster, apps: tuple[client.CoreV1Api, str]
) -> None:
    """Each pod gets an address of its own node's pod network; the client's connection reaches
    the server's pod IP, and the server sees the client's pod IP (no address translation)."""
    core, namespace = apps
    server, idle = _echo_pair(kube_node, core, namespace)
    first, second = kube_node.nodes[0], kube_node.nodes[1]
    assert server.status.pod_ip.startswith(second.pod_subnet.rsplit(".", 2)[0] + "."), server.status.pod_ip
    assert idle.status.pod_ip.startswith(first.pod_subnet.rsplit(".", 2)[0] + "."), idle.status.pod_ip
    with _client(kube_node, namespace, "client") as peer:
        assert peer.ask(f"connect {server.status.pod_ip}")["ok"]
        assert peer.ask("echo 10")["ok"]
    logged = wait_for("the server's log", lambda: core.read_namespaced_pod_log("server", namespace), WAIT_S)
    assert f"from {idle.status.pod_ip}" in logged, logged


@pytest.mark.node_fault
def test_a_partitioned_peer_is_silence_until_healed(kube_node: Cluster, apps: tuple[client.CoreV1Api, str]) -> None:
    """Across a partition a peer hears nothing: the echo on an open connection times out
    (no reset, no ICMP error), and a new connection does too; once healed, the same connection
    carries the echo again."""
    core, namespace = apps
    server, _ = _echo_pair(kube_node, core, namespace)
    second = kube_node.nodes[1].name
    with _client(kube_node, namespace, "client") as peer:
        assert peer.ask(f"connect {server.status.pod_ip}")["ok"]
        assert peer.ask("echo 10")["ok"]
        with _faulted(kube_node, second):
            kube_node.partition(second)
            silent = peer.ask("echo 3")
            assert silent["ok"] is False and silent["error"] == "TimeoutError", silent
            assert silent["seconds"] >= 2.9, silent
            with _client(kube_node, namespace, "client") as stranger:
                refused = stranger.ask(f"connect {server.status.pod_ip}")
            assert refused["ok"] is False and refused["error"] == "TimeoutError", refused
        # The server's process never stopped: the byte sent into the silence comes back first.
        deadline = time.monotonic() + 60
        while not (answer := peer.ask("echo 5"))["ok"] and time.monotonic() < deadline:
            pass
        assert answer["ok"], answer


@pytest.mark.node_fault
def test_a_powered_off_node_goes_not_ready_while_its_pods_stay_running(
    kube_node: Cluster, apps: tuple[client.CoreV1Api, str]
) -> None:
    """Power-off: a connection to a pod there goes silent at once (no reset from the killed
    process); the Node goes NotReady only after the node monitor's grace period (40 s by default),
    and its pod still says Running in the API then. Healed, the node is Ready again and its
    kubelet runs the pod again."""
    core, namespace = apps
    server, _ = _echo_pair(kube_node, core, namespace)
    second = kube_node.nodes[1].name
    with _client(kube_node, namespace, "client") as peer, _faulted(kube_node, second):
        assert peer.ask(f"connect {server.status.pod_ip}")["ok"]
        off = time.monotonic()
        kube_node.power_off(second)
        assert kube_node.powered_off(second)
        silent = peer.ask("echo 3")
        assert silent["ok"] is False and silent["error"] == "TimeoutError", silent

        def not_ready() -> float | None:
            node = core.read_node(second)
            ready = next(c for c in node.status.conditions if c.type == "Ready")
            return time.monotonic() - off if ready.status != "True" else None

        after = wait_for(f"{second} NotReady", not_ready, WAIT_S)
        print(f"{second} NotReady {after:.1f} s after the power-off")
        assert after > 20, f"NotReady after {after:.1f} s: sooner than the kubelet's lease could have lapsed"
        pod = core.read_namespaced_pod("server", namespace)
        assert pod.status.phase == "Running" and pod.metadata.deletion_timestamp is None, pod.status
    assert not kube_node.powered_off(second)
    wait_for(
        "the server running again on its node",
        lambda: (
            (p := core.read_namespaced_pod("server", namespace)).status.phase == "Running"
            and all(s.ready for s in p.status.container_statuses or [])
            and (p.status.container_statuses or [None])[0].restart_count >= 1
        ),
        WAIT_S,
    )
