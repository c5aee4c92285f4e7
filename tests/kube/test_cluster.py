"""The test control plane itself: it answers, stores objects, collects garbage, enforces RBAC."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import multiworld_test_cluster as cluster_module  # registered by conftest.py
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from multiworld_test_cluster import Cluster

pytestmark = pytest.mark.kube

GC_TIMEOUT_S = 90.0
CLUSTER_SCRIPT = Path(cluster_module.__file__)


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


def test_cli_up_and_down_leave_no_process(tmp_path: Path) -> None:
    """`cluster.py up` detaches a working cluster; `down` stops every process it started."""
    directory = tmp_path / "cli-cluster"

    def cli(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(CLUSTER_SCRIPT), command, "--dir", str(directory)],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip

    up = cli("up")
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip() == f"export KUBECONFIG={directory / 'kubeconfig'}"
        pids = {pid_file.stem: int(pid_file.read_text()) for pid_file in directory.glob("*.pid")}
        assert {"etcd", "kube-apiserver"} <= pids.keys()
        with cluster_module.api_client_for(directory / "kubeconfig") as api:
            assert client.VersionApi(api).get_code().major == "1"
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert not [name for name, pid in pids.items() if _running(pid)]
    assert not list(directory.glob("*.pid"))
    assert cli("env").returncode != 0


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
