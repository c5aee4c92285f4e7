"""`helm install` of charts/multiworld-operator into the test API server, with real Helm
(helm-python-sdk): the release deploys, its CRD and RBAC exist and the API server's own
authorizer grants exactly what the operator and the workers need, and users holding the built-in
`edit` or `view` role in a namespace what those roles mean for its MultiWorlds (the
controller-manager aggregates the chart's rules into them); an upgrade that switches to
namespaced RBAC is applied; an uninstall removes everything but the CRD (Helm keeps crds/).
And the real operator, started as the image starts it and holding only the chart's
ServiceAccount token, serves an example MultiWorld in both RBAC modes without a refusal, the
MultiWorld admitted by its webhook."""

from __future__ import annotations

import base64
import functools
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import helm_python as helm
import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from multiworld_operator.kube.admission.certificate import secret_name
from tests.cluster import cluster as cluster_module
from tests.cluster.cluster import Cluster
from tests.support.metrics_support import get_metrics, service_account_token
from tests.support.operator_support import lease_holder, refusals, stop_operator
from tests.support.webhook_support import serve_from_this_host, wait_ca_bundle, wait_listening

pytestmark = pytest.mark.kube

CHART_DIR = Path(__file__).resolve().parents[2] / "charts" / "multiworld-operator"
CRD_NAME = "multiworlds.multiworld.io"
WORKER_SA = "multiworld-worker"
HELM_TIMEOUT_S = 120
GONE_TIMEOUT_S = 90.0
# The controller-manager's ClusterRole aggregation runs as the labelled roles change.
AGGREGATED_TIMEOUT_S = 30.0
OPERATOR_TIMEOUT_S = 120.0
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "all_gather" / "multiworld.yaml"


@contextmanager
def extra_namespace(api: client.ApiClient) -> Iterator[str]:
    core = client.CoreV1Api(api)
    name = f"test-{uuid.uuid4().hex[:10]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        core.delete_namespace(name)


def allowed(
    api: client.ApiClient, account: tuple[str, str], verb: str, resource: str, namespace: str | None, group: str = ""
) -> bool:
    """The API server's own answer to: may this ServiceAccount do this?"""
    sa_namespace, sa_name = account
    resource, _, subresource = resource.partition("/")
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=f"system:serviceaccount:{sa_namespace}:{sa_name}",
            groups=["system:serviceaccounts", f"system:serviceaccounts:{sa_namespace}", "system:authenticated"],
            resource_attributes=client.V1ResourceAttributes(
                verb=verb, group=group, resource=resource, subresource=subresource or None, namespace=namespace
            ),
        )
    )
    return bool(client.AuthorizationV1Api(api).create_subject_access_review(review).status.allowed)


def bind_built_in_role(api: client.ApiClient, namespace: str, role: str) -> tuple[str, str]:
    """A ServiceAccount `<role>-user` of `namespace` holding the built-in ClusterRole `role` there."""
    account = f"{role}-user"
    binding = client.V1RoleBinding(
        metadata=client.V1ObjectMeta(name=account),
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=role),
        subjects=[client.RbacV1Subject(kind="ServiceAccount", name=account, namespace=namespace)],
    )
    client.RbacAuthorizationV1Api(api).create_namespaced_role_binding(namespace, binding)
    return namespace, account


def exists(read: Callable[[], Any]) -> bool:
    try:
        read()
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


def release_objects(
    api: client.ApiClient, fullname: str, namespace: str, role_namespaces: list[str]
) -> dict[str, bool]:
    """Whether each object the release should own exists, by a readable name."""
    core, apps, rbac = client.CoreV1Api(api), client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    found = {
        f"Deployment {namespace}/{fullname}": exists(lambda: apps.read_namespaced_deployment(fullname, namespace)),
        f"ServiceAccount {namespace}/{fullname}": exists(
            lambda: core.read_namespaced_service_account(fullname, namespace)
        ),
        f"ClusterRole {fullname}": exists(lambda: rbac.read_cluster_role(fullname)),
        f"ClusterRoleBinding {fullname}": exists(lambda: rbac.read_cluster_role_binding(fullname)),
        f"ClusterRole {fullname}-metrics-reader": exists(lambda: rbac.read_cluster_role(f"{fullname}-metrics-reader")),
        f"ClusterRole {fullname}-edit": exists(lambda: rbac.read_cluster_role(f"{fullname}-edit")),
        f"ClusterRole {fullname}-view": exists(lambda: rbac.read_cluster_role(f"{fullname}-view")),
        f"ValidatingWebhookConfiguration {fullname}": exists(
            lambda: client.AdmissionregistrationV1Api(api).read_validating_webhook_configuration(fullname)
        ),
        f"Service {namespace}/{fullname}-webhook": exists(
            lambda: core.read_namespaced_service(f"{fullname}-webhook", namespace)
        ),
        f"Service {namespace}/{fullname} (the worker channel)": exists(
            lambda: core.read_namespaced_service(fullname, namespace)
        ),
        f"ServiceAccount {namespace}/{WORKER_SA}": exists(
            lambda: core.read_namespaced_service_account(WORKER_SA, namespace)
        ),
    }
    for ns in role_namespaces:
        found[f"Role {ns}/{fullname}"] = exists(functools.partial(rbac.read_namespaced_role, fullname, ns))
        found[f"RoleBinding {ns}/{fullname}"] = exists(
            functools.partial(rbac.read_namespaced_role_binding, fullname, ns)
        )
    return found


def operator_container(api: client.ApiClient, fullname: str, namespace: str) -> client.V1Container:
    deployment = client.AppsV1Api(api).read_namespaced_deployment(fullname, namespace)
    (container,) = deployment.spec.template.spec.containers
    return container


def test_install_upgrade_uninstall(kube_cluster: Cluster, namespace: str) -> None:
    release = f"mw-{uuid.uuid4().hex[:6]}"
    fullname = f"{release}-multiworld-operator"
    operator_sa = (namespace, fullname)
    worker_sa = (namespace, WORKER_SA)
    with (
        kube_cluster.api_client() as api,
        extra_namespace(api) as watched,
        helm.Config(kubeconfig_path=str(kube_cluster.kubeconfig), namespace=namespace) as config,
    ):
        installed = config.install(CHART_DIR, release, {}, timeout=HELM_TIMEOUT_S)
        assert (installed["status"], installed["revision"]) == ("deployed", 1)
        assert config.status(release)["status"] == "deployed"
        assert f"serviceAccountName: {WORKER_SA}" in installed["notes"]

        crd = client.ApiextensionsV1Api(api).read_custom_resource_definition(CRD_NAME)
        assert crd.spec.names.short_names == ["mw"]
        objects = release_objects(api, fullname, namespace, [])
        assert all(objects.values()), objects

        # Watching every namespace: the operator may manage Pods anywhere, read CRDs, and no more.
        for ns in (namespace, watched):
            assert allowed(api, operator_sa, "create", "pods", ns)
            assert allowed(api, operator_sa, "patch", "multiworlds/status", ns, "multiworld.io")
            assert allowed(api, operator_sa, "create", "events", ns)
        assert allowed(api, operator_sa, "watch", "customresourcedefinitions", None, "apiextensions.k8s.io")
        assert not allowed(api, operator_sa, "get", "secrets", namespace)
        assert not allowed(api, operator_sa, "delete", "multiworlds", namespace, "multiworld.io")
        # The workers may do nothing with the API (`kubectl auth can-i --as` answers no).
        for verb, resource in (("patch", "pods"), ("update", "pods"), ("delete", "pods"), ("create", "configmaps"),
                               ("update", "configmaps"), ("patch", "configmaps"), ("list", "configmaps"),
                               ("create", "events")):  # fmt: skip
            assert not allowed(api, worker_sa, verb, resource, namespace), (verb, resource)
        assert not allowed(api, worker_sa, "get", "multiworlds", namespace, "multiworld.io")
        assert allowed(api, operator_sa, "update", "configmaps", namespace)
        assert allowed(api, operator_sa, "create", "tokenreviews", None, "authentication.k8s.io")
        assert allowed(api, operator_sa, "create", "subjectaccessreviews", None, "authorization.k8s.io")
        with kube_cluster.serviceaccount_api_client(*worker_sa) as worker:
            with pytest.raises(ApiException) as forbidden:
                client.CoreV1Api(worker).list_namespaced_config_map(namespace)
            assert forbidden.value.status == 403

        # Users hold MultiWorlds through Kubernetes' own roles, bound in their namespace only.
        editor, viewer = bind_built_in_role(api, watched, "edit"), bind_built_in_role(api, watched, "view")
        cluster_module.wait_for(
            "the controller-manager to aggregate the chart's rules into edit and view",
            lambda: (
                allowed(api, editor, "create", "multiworlds", watched, "multiworld.io")
                and allowed(api, viewer, "watch", "multiworlds", watched, "multiworld.io")
            ),
            AGGREGATED_TIMEOUT_S,
        )
        for verb in ("delete", "patch", "update", "get", "list"):
            assert allowed(api, editor, verb, "multiworlds", watched, "multiworld.io"), verb
        for account in (editor, viewer):
            assert allowed(api, account, "get", "multiworlds/status", watched, "multiworld.io")
            assert not allowed(api, account, "patch", "multiworlds/status", watched, "multiworld.io")
            assert not allowed(api, account, "update", "multiworlds/status", watched, "multiworld.io")
            assert not allowed(api, account, "get", "multiworlds", namespace, "multiworld.io")
        assert not allowed(api, viewer, "create", "multiworlds", watched, "multiworld.io")

        # Upgrade to namespaced RBAC (the release namespace and one more) with a new log level.
        upgraded = config.upgrade(
            CHART_DIR, release, {"watchNamespaces": [namespace, watched], "logLevel": "DEBUG"}, timeout=HELM_TIMEOUT_S
        )
        assert (upgraded["status"], upgraded["revision"]) == ("deployed", 2)
        container = operator_container(api, fullname, namespace)
        watched_args = [container.args[i + 1] for i, arg in enumerate(container.args) if arg == "--namespace"]
        assert watched_args == [namespace, watched]
        assert {env.name: env.value for env in container.env}["MULTIWORLD_LOG_LEVEL"] == "DEBUG"
        assert all(release_objects(api, fullname, namespace, [namespace, watched]).values())
        assert allowed(api, operator_sa, "create", "pods", watched)
        assert allowed(api, operator_sa, "list", "customresourcedefinitions", None, "apiextensions.k8s.io")
        assert not allowed(api, operator_sa, "create", "pods", "default")
        assert not allowed(api, operator_sa, "list", "pods", None)
        # Leader election: the Lease in the release namespace only.
        assert allowed(api, operator_sa, "create", "leases", namespace, "coordination.k8s.io")
        assert not allowed(api, operator_sa, "create", "leases", watched, "coordination.k8s.io")
        assert exists(lambda: client.CoreV1Api(api).read_namespaced_service_account(WORKER_SA, watched))
        assert not allowed(api, (watched, WORKER_SA), "patch", "pods", watched)

        config.uninstall(release, timeout=HELM_TIMEOUT_S)
        cluster_module.wait_for(
            f"every object of release {release} to be deleted",
            lambda: not any(release_objects(api, fullname, namespace, [namespace, watched]).values()) or None,
            GONE_TIMEOUT_S,
        )
        with pytest.raises(helm.HelmNotFoundError):
            config.status(release)
        cluster_module.wait_for(
            "the built-in edit role to lose the uninstalled release's rules",
            lambda: not allowed(api, editor, "create", "multiworlds", watched, "multiworld.io"),
            AGGREGATED_TIMEOUT_S,
        )
        # Helm never deletes what it installed from crds/: MultiWorlds outlive the operator.
        assert exists(lambda: client.ApiextensionsV1Api(api).read_custom_resource_definition(CRD_NAME))


def test_install_refuses_bad_values_and_creates_nothing(kube_cluster: Cluster, namespace: str) -> None:
    release = f"mw-{uuid.uuid4().hex[:6]}"
    with (
        kube_cluster.api_client() as api,
        helm.Config(kubeconfig_path=str(kube_cluster.kubeconfig), namespace=namespace) as config,
    ):
        without_election = {"replicas": 2, "leaderElection": {"enabled": False, "leaseDuration": 15}}
        with pytest.raises(helm.HelmError, match="/replicas"):
            config.install(CHART_DIR, release, without_election, timeout=HELM_TIMEOUT_S)
        assert not any(release_objects(api, f"{release}-multiworld-operator", namespace, []).values())
        assert config.list(all_states=True) == []


@contextmanager
def operator_process(kube_cluster: Cluster, namespace: str, fullname: str, log_path: Path) -> Iterator[int]:
    """`multiworld operator` with the args and env of the chart's Deployment, authenticated only
    by the chart's operator ServiceAccount; yields its health port. Of the downward API's
    variables, POD_NAMESPACE is the release's (where the world key's Secret is); POD_NAME has
    none outside a pod: the operator then names itself on the Lease by host and pid."""
    with kube_cluster.api_client() as api:
        container = operator_container(api, fullname, namespace)
    kubeconfig = kube_cluster.serviceaccount_kubeconfig(namespace, fullname)
    plain = {e.name: e.value for e in container.env if e.value_from is None}
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), **plain, "POD_NAMESPACE": namespace}
    entrypoint = [str(Path(sys.executable).parent / "multiworld"), "operator"]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(entrypoint + container.args, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        yield container.ports[0].container_port
    finally:
        stop_operator(process)


def scrape(api: client.ApiClient, namespace: str, fullname: str, port: int) -> str:
    """The metrics as the chart's ServiceMonitor reads them: over TLS verified with the webhook
    Secret's ca.crt for the webhook Service's name (every replica shows the webhook's
    certificate), bearing the token of a ServiceAccount bound to the chart's metrics-reader."""
    container = operator_container(api, fullname, namespace)
    server_name = container.args[container.args.index("--webhook-host") + 1]
    secret = client.CoreV1Api(api).read_namespaced_secret(secret_name(fullname), namespace)
    ca = base64.b64decode(secret.data["ca.crt"]).decode()
    with service_account_token(api, namespace, "prometheus", f"{fullname}-metrics-reader") as token:
        answer = get_metrics(port, token, ca=ca, server_name=server_name)
    assert answer.status == 200, answer
    return answer.body


def healthy(port: int) -> bool | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return response.status == 200 or None
    except OSError:
        return None


@pytest.mark.parametrize("mode", ["all-namespaces", "namespaced"])
def test_operator_serves_a_multiworld_with_only_the_charts_rbac(
    kube_cluster: Cluster, namespace: str, mode: str, tmp_path: Path
) -> None:
    release = f"mw-{uuid.uuid4().hex[:6]}"
    fullname = f"{release}-multiworld-operator"
    webhook_port, metrics_port = cluster_module.free_port(), cluster_module.free_port()
    values: dict[str, Any] = {
        "healthPort": cluster_module.free_port(),
        "channelPort": cluster_module.free_port(),
        "webhook": {"port": webhook_port},
        "metrics": {"port": metrics_port},
    }
    if mode == "namespaced":
        values["watchNamespaces"] = [namespace]
    manifest = yaml.safe_load(EXAMPLE.read_text())
    name = manifest["metadata"]["name"]
    pod_count = sum(member.get("replicas", 1) for member in manifest["spec"]["members"])
    log_path = tmp_path / "operator.log"
    with (
        kube_cluster.api_client() as api,
        helm.Config(kubeconfig_path=str(kube_cluster.kubeconfig), namespace=namespace) as config,
    ):
        config.install(CHART_DIR, release, values, timeout=HELM_TIMEOUT_S)
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        try:
            # The MultiWorld passes the operator's admission webhook on its way in.
            serve_from_this_host(api, fullname, webhook_port, [namespace])
            with operator_process(kube_cluster, namespace, fullname, log_path) as health_port:
                wait_ca_bundle(api, fullname)
                wait_listening(webhook_port)
                custom.create_namespaced_custom_object("multiworld.io", "v1alpha1", namespace, "multiworlds", manifest)
                pods = cluster_module.wait_for(
                    f"the operator to create the {pod_count} pods of {name}",
                    lambda: (lambda items: items if len(items) == pod_count else None)(
                        core.list_namespaced_pod(namespace, label_selector=f"multiworld.io/name={name}").items
                    ),
                    OPERATOR_TIMEOUT_S,
                )
                assert exists(lambda: core.read_namespaced_service(name, namespace))
                cluster_module.wait_for(
                    f"the operator to write the status of {name}",
                    lambda: (
                        cast(
                            "dict[str, Any]",  # the custom object, as JSON
                            custom.get_namespaced_custom_object(
                                "multiworld.io", "v1alpha1", namespace, "multiworlds", name
                            ),
                        )
                        .get("status", {})
                        .get("phase")
                    ),
                    OPERATOR_TIMEOUT_S,
                )
                assert cluster_module.wait_for(
                    "the liveness endpoint", lambda: healthy(health_port), OPERATOR_TIMEOUT_S
                )
                # Its metrics, on the port the chart gave it: the leader, and the MultiWorld's worlds.
                metrics = scrape(api, namespace, fullname, metrics_port)
                assert "multiworld_operator_leader 1.0" in metrics.splitlines(), metrics
                assert f'multiworld="{name}"' in metrics and "multiworld_world_epoch{" in metrics, metrics
                # It acted as the leader, on the Lease the chart lets it hold.
                assert lease_holder(api, namespace, fullname)
        finally:
            config.uninstall(release, timeout=HELM_TIMEOUT_S)
        assert {pod.spec.service_account_name for pod in pods} == {WORKER_SA}
    log = log_path.read_text(errors="replace")
    assert not refusals(log), log[-3000:]
