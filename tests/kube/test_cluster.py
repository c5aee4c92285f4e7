"""The test cluster itself: the control plane answers, stores objects, collects garbage, enforces
RBAC; the real node runs pods with cluster DNS and in-cluster API access; `down` cleans up."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.cluster import cluster as cluster_module, images as images_module
from tests.cluster.cluster import Cluster
from tests.cluster.node import Node
from tests.cluster.node_host import BRIDGE, MARKER

pytestmark = pytest.mark.kube

GC_TIMEOUT_S = 90.0
# `python3 -m tests.cluster.cluster`, run from the repository root as `make cluster` runs it.
REPO = Path(__file__).resolve().parents[2]
CLUSTER_CLI = ["-m", cluster_module.__name__]


def _configmap(name: str, data: dict[str, str], owner: client.V1ConfigMap | None = None) -> client.V1ConfigMap:
    owners = None
    if owner is not None:
        owners = [
            client.V1OwnerReference(
                api_version="v1", kind="ConfigMap", name=owner.metadata.name, uid=owner.metadata.uid
            )
        ]
    return client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, owner_references=owners), data=data)


def _configmap_names(core: client.CoreV1Api, namespace: str) -> set[str]:
    return {item.metadata.name for item in core.list_namespaced_config_map(namespace).items}


def _running(pid: int) -> bool:
    """A live process (not an exited one waiting for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_api_server_answers(kube_cluster: Cluster) -> None:
    with kube_cluster.api_client() as api:
        version = client.VersionApi(api).get_code()
        namespaces = {ns.metadata.name for ns in client.CoreV1Api(api).list_namespace().items}
    assert version.major == "1" and version.git_version.startswith("v1.")
    assert {"default", "kube-system"} <= namespaces


def test_configmap_round_trip(kube_cluster: Cluster, namespace: str) -> None:
    with kube_cluster.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_config_map(namespace, _configmap("settings", {"worlds": "3", "backend": "gloo"}))
        assert core.read_namespaced_config_map("settings", namespace).data == {"worlds": "3", "backend": "gloo"}

        core.patch_namespaced_config_map("settings", namespace, {"data": {"worlds": "4"}})
        assert core.read_namespaced_config_map("settings", namespace).data == {"worlds": "4", "backend": "gloo"}

        core.delete_namespaced_config_map("settings", namespace)
        with pytest.raises(ApiException) as missing:
            core.read_namespaced_config_map("settings", namespace)
    assert missing.value.status == 404


def test_owner_reference_garbage_collection(kube_cluster: Cluster, namespace: str) -> None:
    kube_cluster.require_controller_manager("owner-reference garbage collection")
    with kube_cluster.api_client() as api:
        core = client.CoreV1Api(api)
        owner = core.create_namespaced_config_map(namespace, _configmap("owner", {"role": "owner"}))
        core.create_namespaced_config_map(namespace, _configmap("dependent", {"role": "dependent"}, owner))
        core.create_namespaced_config_map(namespace, _configmap("bystander", {"role": "bystander"}))

        core.delete_namespaced_config_map("owner", namespace, propagation_policy="Background")
        cluster_module.wait_for(
            "the garbage collector to delete the dependent ConfigMap",
            lambda: "dependent" not in _configmap_names(core, namespace),
            GC_TIMEOUT_S,
        )
        assert _configmap_names(core, namespace) >= {"bystander"}
        assert "owner" not in _configmap_names(core, namespace)


def test_serviceaccount_gets_only_what_rbac_grants(kube_cluster: Cluster, namespace: str) -> None:
    with kube_cluster.api_client() as api:
        core = client.CoreV1Api(api)
        rbac = client.RbacAuthorizationV1Api(api)
        core.create_namespaced_service_account(
            namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="reader"))
        )
        rbac.create_namespaced_role(
            namespace,
            client.V1Role(
                metadata=client.V1ObjectMeta(name="configmap-reader"),
                rules=[client.V1PolicyRule(api_groups=[""], resources=["configmaps"], verbs=["get", "list"])],
            ),
        )
        rbac.create_namespaced_role_binding(
            namespace,
            client.V1RoleBinding(
                metadata=client.V1ObjectMeta(name="reader"),
                role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="configmap-reader"),
                subjects=[client.RbacV1Subject(kind="ServiceAccount", name="reader", namespace=namespace)],
            ),
        )
        core.create_namespaced_config_map(namespace, _configmap("visible", {"k": "v"}))

    with kube_cluster.serviceaccount_api_client(namespace, "reader") as sa_api:
        sa_core = client.CoreV1Api(sa_api)
        assert "visible" in _configmap_names(sa_core, namespace)
        refused = [
            lambda: sa_core.list_namespaced_secret(namespace),
            lambda: sa_core.create_namespaced_config_map(namespace, _configmap("forbidden", {})),
            lambda: sa_core.list_config_map_for_all_namespaces(),
            lambda: sa_core.list_namespaced_config_map("default"),
        ]
        for attempt in refused:
            with pytest.raises(ApiException) as denied:
                attempt()
            assert denied.value.status == 403


# Run in a pod of the worker image: cluster DNS for a headless Service's pod record (the short
# form a pod uses and the full name) and for the `kubernetes` Service, and the in-cluster client
# authenticated as the pod's ServiceAccount (which may list pods, and nothing else).
PROBE = """
import json, socket, time
from kubernetes import client, config
config.load_incluster_config()
namespace = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
names = ["probe.peers", f"probe.peers.{namespace}.svc.cluster.local", "kubernetes.default.svc"]

def resolve(name):  # a pod's own record appears once its address is in the Endpoints
    deadline = time.monotonic() + 60
    while True:
        try:
            return socket.gethostbyname(name)
        except socket.gaierror:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)

print(json.dumps({"resolved": {name: resolve(name) for name in names},
                  "pods": [p.metadata.name for p in client.CoreV1Api().list_namespaced_pod(namespace).items]}))
"""


def _pod_probe(cluster: Cluster, namespace: str) -> dict[str, Any]:
    """Run PROBE in a pod named `probe` (hostname `probe`, subdomain `peers`) and read its output."""
    with cluster.api_client() as api:
        core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
        cluster_module.wait_for(
            "the default ServiceAccount", lambda: core.list_namespaced_service_account(namespace).items, 60
        )
        rbac.create_namespaced_role(
            namespace,
            {  # type: ignore[arg-type]  # a dict body, sent as is
                "metadata": {"name": "list-pods"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
            },
        )
        rbac.create_namespaced_role_binding(
            namespace,
            {  # type: ignore[arg-type]  # a dict body, sent as is
                "metadata": {"name": "list-pods"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "list-pods"},
                "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
            },
        )
        core.create_namespaced_service(
            namespace,
            {  # type: ignore[arg-type]  # a dict body, sent as is
                "metadata": {"name": "peers"},
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": "probe"}},
            },
        )
        core.create_namespaced_pod(
            namespace,
            {  # type: ignore[arg-type]  # a dict body, sent as is
                "metadata": {"name": "probe", "labels": {"app": "probe"}},
                "spec": {
                    "hostname": "probe",
                    "subdomain": "peers",
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "probe",
                            # The operator's image: it has the Kubernetes client (the worker's has none).
                            "image": "multiworld/operator:dev",
                            "imagePullPolicy": "Never",
                            "command": ["python", "-c", PROBE],
                        }
                    ],
                },
            },
        )
        phase = cluster_module.wait_for(
            "the probe pod to end",
            lambda: (
                core.read_namespaced_pod("probe", namespace).status.phase in ("Succeeded", "Failed")
                and core.read_namespaced_pod("probe", namespace).status.phase
            ),
            180,
        )
        log = core.read_namespaced_pod_log("probe", namespace)
        assert phase == "Succeeded", log
        result = json.loads(log.strip().splitlines()[-1])
        result["ip"] = core.read_namespaced_pod("probe", namespace).status.pod_ip
        return result


def _host_traces(directory: Path) -> dict[str, list[str]]:
    """What nodes leave on the host: processes and mounts of their folders (or their socket
    folders: containerd's shims), the node bridge and links, their network namespaces, and
    iptables chains of kubelet, kube-proxy and CNI."""
    nodes = Cluster(directory).nodes
    assert nodes, f"no node folder in {directory}"
    marks = (str(directory), *(str(node.run_dir) for node in nodes))
    processes = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and any(mark in cmdline for mark in marks) and _running(int(entry.name)):
            processes.append(cmdline.replace("\0", " "))
    mounts = [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if any(mark in line.split()[4] for mark in (*marks, "/run/netns/cni-"))
    ]
    links = [
        line
        for line in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()
        if line.split(":")[1].strip().split("@")[0] in {"cni0", BRIDGE, *(node.veth for node in nodes)}
    ]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    chains = [
        line
        for tool in ("iptables-save", "ip6tables-save")
        for line in subprocess.run([tool], capture_output=True, text=True).stdout.splitlines()
        if line.startswith((":KUBE-", ":CNI-"))
    ]
    folders = [mark for mark in marks[1:] if Path(mark).exists()]
    return {
        "processes": processes,
        "mounts": mounts,
        "links": links,
        "namespaces": [name for name in namespaces if name in {node.netns for node in nodes}],
        "chains": chains,
        "folders": folders,
    }


@pytest.mark.timeout(900)
def test_cli_up_runs_a_real_node_and_down_leaves_nothing(tmp_path: Path) -> None:
    """`cluster.py up` detaches a cluster with a Ready node whose pods get cluster DNS and reach
    the API as their ServiceAccount, even where a killed node left its marker and containerd's
    socket file; `down` leaves no process, mount, bridge or iptables chain."""
    directory = tmp_path / "cli-cluster"
    crashed = _plant_a_killed_node(tmp_path / "killed-node")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *CLUSTER_CLI, *args, "--dir", str(directory)],
            capture_output=True, text=True, timeout=600, check=False, cwd=REPO,
        )  # fmt: skip

    up = cli("up")
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig, path = up.stdout.strip().splitlines()
        assert kubeconfig == f"export KUBECONFIG={directory / 'kubeconfig'}"
        kubectl = cluster_module.find_node_binaries().kubectl
        assert path == f'export PATH="{kubectl.parent}:$PATH"', up.stdout
        pids = {f.stem: int(f.read_text().split()[0]) for f in directory.glob("*.pid")}
        assert {"etcd", "kube-apiserver", "kubelet", "containerd", "dnsmasq"} <= pids.keys()
        cluster = Cluster(directory)
        nodes = subprocess.run(
            [str(kubectl), f"--kubeconfig={cluster.kubeconfig}", "get", "nodes", "--no-headers"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert nodes.split()[:2] == ["multiworld-node", "Ready"], nodes
        images_module.load_images(str(cluster.node.socket))
        probe = _pod_probe(cluster, "probe-test")
        assert set(probe["resolved"].values()) == {probe["ip"], cluster_module.SERVICE_CLUSTER_IP}, probe
        assert probe["resolved"]["probe.peers"] == probe["ip"]
        assert probe["pods"] == ["probe"]
        # A second cluster with a node is refused while this one runs, and leaves it running.
        second = subprocess.run([sys.executable, *CLUSTER_CLI, "up", "--dir", str(tmp_path / "second")],
                                capture_output=True, text=True, timeout=600, check=False, cwd=REPO)  # fmt: skip
        assert second.returncode != 0 and "a node already runs on this machine" in second.stderr, second.stderr
        assert _host_traces(directory)["links"], "the refused cluster removed the running one's links"
        assert _pod_probe(cluster, "probe-again")["pods"] == ["probe"]
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert not [name for name, pid in pids.items() if _running(pid)]
    assert _host_traces(directory) == {
        "processes": [],
        "mounts": [],
        "links": [],
        "namespaces": [],
        "chains": [],
        "folders": [],
    }
    assert not list(directory.glob("*.pid"))
    assert cli("env").returncode != 0
    assert not crashed.run_dir.exists()


def _plant_a_killed_node(directory: Path) -> Node:
    """What a node killed with its machine leaves: the host marker naming its folder, and
    containerd's socket file with nobody serving it. Where a killed run left them for real, those."""
    if MARKER.exists():
        return Node(Path(json.loads(MARKER.read_text())["directory"]))
    crashed = Node(directory)
    crashed.run_dir.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(crashed.socket))
    MARKER.write_text(json.dumps({"directory": str(directory), "sysctls": {}}))
    return crashed


def test_cli_up_without_nodes_serves_the_control_plane_alone(tmp_path: Path) -> None:
    directory = tmp_path / "cli-control-plane"
    argv = [sys.executable, *CLUSTER_CLI]
    up = subprocess.run([*argv, "up", "--nodes", "0", "--dir", str(directory)], capture_output=True, text=True,
                        timeout=600, check=False, cwd=REPO)  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr
        assert {f.stem for f in directory.glob("*.pid")} == {"etcd", "kube-apiserver", "kube-controller-manager"}
    finally:
        down = subprocess.run(
            [*argv, "down", "--dir", str(directory)], capture_output=True, text=True, check=False, cwd=REPO
        )
    assert down.returncode == 0, down.stderr
    assert not list(directory.glob("*.pid"))


def test_missing_asset_named_in_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    not_executable = tmp_path / "etcd"
    not_executable.write_text("")
    monkeypatch.setenv("TEST_ASSET_ETCD", str(not_executable))
    with pytest.raises(cluster_module.ClusterError, match="TEST_ASSET_ETCD"):
        cluster_module.find_binaries()


def test_kubebuilder_assets_used_without_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("etcd", "kube-apiserver"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.delenv("TEST_ASSET_ETCD", raising=False)
    monkeypatch.delenv("TEST_ASSET_KUBE_APISERVER", raising=False)
    monkeypatch.delenv("TEST_ASSET_KUBE_CONTROLLER_MANAGER", raising=False)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    monkeypatch.setattr(cluster_module, "BUILD_SCRIPT", tmp_path / "must-not-run.sh")
    binaries = cluster_module.find_binaries()
    assert binaries == cluster_module.Binaries(tmp_path / "etcd", tmp_path / "kube-apiserver", None)


@pytest.mark.quick
def test_the_control_planes_ports_are_no_ports_the_kernel_hands_out() -> None:
    """etcd and the API server get their ports from the cluster before they bind them. A port the
    kernel hands out (binding port 0) may meanwhile go to any outgoing connection, the API
    server's own to etcd among them: it then fails to start with EADDRINUSE (seen in CI)."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [cluster_module.free_port() for _ in range(50)]
    assert not [port for port in ports if low <= port <= high]


@pytest.mark.quick
def test_the_cluster_module_loads_in_a_bare_python() -> None:
    """`make kube-binaries` and `make cluster` run it with the machine's python3, which has none
    of the project's packages (a fresh clone's CI failed there once)."""
    bare = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    assert bare is not None
    loaded = subprocess.run(
        [bare, "-c", f"import {cluster_module.__name__}"], cwd=REPO, capture_output=True, text=True, env={}
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
