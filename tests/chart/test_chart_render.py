"""The chart lints clean and renders least-privilege RBAC, the Deployment and the workers'
identity in both RBAC modes (all namespaces, or a list of namespaces), and two replicas that
elect a leader on a Lease (or, with leader election off, one replica at most)."""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterable
from typing import Any

import helm_python as helm
import pytest

from multiworld_operator.kube.admission.certificate import secret_name
from multiworld_operator.kube.admission.webhook import HANDLER_ID
from multiworld_operator.kube.workers.world_key import ENV_WORLD_KEY_SECRET
from tests.support.chart_support import (
    CHART_DIR,
    FULLNAME,
    RELEASE_NAMESPACE,
    REPO,
    Manifest,
    Rendered,
    example_pod_templates,
)

pytestmark = pytest.mark.quick

Grant = tuple[str, str, str]  # (apiGroup, resource, verb)


def grants(group: str, resources: Iterable[str], verbs: Iterable[str]) -> set[Grant]:
    return {(group, resource, verb) for resource in resources for verb in verbs}


# What the operator does in a managed namespace (see the brief of the operator): nothing more.
OPERATOR_IN_NAMESPACE = (
    grants("multiworld.io", ["multiworlds"], ["get", "list", "watch"])
    | grants("multiworld.io", ["multiworlds/status"], ["patch"])
    | grants("", ["pods"], ["get", "list", "watch", "create", "delete", "patch"])  # patch: a spare's labels
    | grants("", ["services"], ["get", "list", "watch", "create"])
    | grants("", ["events"], ["create"])
    | grants("networking.k8s.io", ["networkpolicies"], ["get", "list", "watch", "create", "patch", "delete"])
    | grants("", ["configmaps"], ["get", "create", "update"])  # the memory
)
# What only a ClusterRole can grant: kopf's reads of CRDs (to notice the MultiWorld resource) and
# namespaces, TokenReviews (which pod a worker channel connection speaks for, whose token a
# request for the metrics bears) and SubjectAccessReviews (whether that user may get /metrics).
KOPF_CLUSTER_READS = (
    grants("apiextensions.k8s.io", ["customresourcedefinitions"], ["list", "watch"])
    | grants("", ["namespaces"], ["list", "watch"])
    | grants("authentication.k8s.io", ["tokenreviews"], ["create"])
    | grants("authorization.k8s.io", ["subjectaccessreviews"], ["create"])
)
# The admission webhook's CA, written into the release's own webhook configuration only.
WEBHOOK_CA = grants("admissionregistration.k8s.io", ["validatingwebhookconfigurations"], ["get", "patch"])

NAMESPACED = {"watchNamespaces": ["team-a", "team-b"]}
WEBHOOK_DEFAULTS = {"enabled": True, "failurePolicy": "Fail", "port": 9443, "timeoutSeconds": 5}
BOTH_MODES = pytest.mark.parametrize("values", [{}, NAMESPACED], ids=["all-namespaces", "namespaced"])


def granted(role: Manifest) -> set[Grant]:
    """Every (group, resource, verb) a Role or ClusterRole allows."""
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def strings_in(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings_in(item)


def operator_subject() -> dict[str, str]:
    return {"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NAMESPACE}


def container(rendered: Rendered) -> Manifest:
    deployment = rendered.one("Deployment", FULLNAME, RELEASE_NAMESPACE)
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


@BOTH_MODES
def test_lint_is_clean(values: dict[str, Any]) -> None:
    report = helm.lint(CHART_DIR, values, strict=True, namespace=RELEASE_NAMESPACE)
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == []


@BOTH_MODES
def test_no_rule_uses_a_wildcard(render: Callable[..., Rendered], values: dict[str, Any]) -> None:
    roles = render(values).of_kind("ClusterRole") + render(values).of_kind("Role")
    assert roles
    for role in roles:
        assert not [s for s in strings_in(role["rules"]) if "*" in s], role["metadata"]["name"]


def test_all_namespaces_mode_grants_through_one_cluster_role(render: Callable[..., Rendered]) -> None:
    rendered = render()
    cluster_role = rendered.one("ClusterRole", FULLNAME)
    assert granted(cluster_role) == OPERATOR_IN_NAMESPACE | KOPF_CLUSTER_READS | WEBHOOK_CA
    binding = rendered.one("ClusterRoleBinding", FULLNAME)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": FULLNAME}
    assert binding["subjects"] == [operator_subject()]
    assert [r for r in rendered.of_kind("Role") if r["metadata"]["name"] == FULLNAME] == []
    assert "--namespace" not in container(rendered)["args"]


def test_namespaced_mode_grants_a_role_per_namespace_and_only_kopf_reads_cluster_wide(
    render: Callable[..., Rendered],
) -> None:
    rendered = render(NAMESPACED)
    assert granted(rendered.one("ClusterRole", FULLNAME)) == KOPF_CLUSTER_READS | WEBHOOK_CA
    for namespace in NAMESPACED["watchNamespaces"]:
        assert granted(rendered.one("Role", FULLNAME, namespace)) == OPERATOR_IN_NAMESPACE
        binding = rendered.one("RoleBinding", FULLNAME, namespace)
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["roleRef"]["name"] == FULLNAME
        assert binding["subjects"] == [operator_subject()]
    operator_roles = [r for r in rendered.of_kind("Role") if r["metadata"]["name"] == FULLNAME]
    assert sorted(r["metadata"]["namespace"] for r in operator_roles) == NAMESPACED["watchNamespaces"]
    args = container(rendered)["args"]
    watched = [args[i + 1] for i, arg in enumerate(args) if arg == "--namespace"]
    assert watched == NAMESPACED["watchNamespaces"]


READ = ["get", "list", "watch"]
AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def test_users_get_multiworlds_through_the_built_in_admin_edit_and_view_roles(
    render: Callable[..., Rendered],
) -> None:
    """`edit` and `admin` may do all a user does with MultiWorlds, `view` may read them, and none
    may write a status (the operator's); with userRoles.aggregate false, nothing is aggregated."""
    rendered = render()
    edit = rendered.one("ClusterRole", f"{FULLNAME}-edit")
    assert {k for k, v in edit["metadata"]["labels"].items() if k.startswith(AGGREGATE) and v == "true"} == {
        AGGREGATE + "admin",
        AGGREGATE + "edit",
    }
    assert granted(edit) == grants(
        "multiworld.io", ["multiworlds"], ["create", "delete", "deletecollection", "patch", "update", *READ]
    ) | grants("multiworld.io", ["multiworlds/status"], READ)
    view = rendered.one("ClusterRole", f"{FULLNAME}-view")
    assert {k for k in view["metadata"]["labels"] if k.startswith(AGGREGATE)} == {AGGREGATE + "view"}
    assert granted(view) == grants("multiworld.io", ["multiworlds", "multiworlds/status"], READ)
    names = {role["metadata"]["name"] for role in render({"userRoles": {"aggregate": False}}).of_kind("ClusterRole")}
    assert names.isdisjoint({f"{FULLNAME}-edit", f"{FULLNAME}-view"}), names


def test_the_worker_channel_is_served_through_a_service(render: Callable[..., Rendered]) -> None:
    rendered = render({"channelPort": 9443})
    service = rendered.one("Service", FULLNAME, RELEASE_NAMESPACE)
    assert service["spec"]["ports"] == [{"name": "channel", "protocol": "TCP", "port": 9443, "targetPort": "channel"}]
    # Only the replica that leads serves workers (a standby refuses them all).
    assert service["spec"]["selector"]["multiworld.io/operator-leader"] == "true"
    env = {e["name"]: e.get("value") for e in container(rendered)["env"]}
    assert env["MULTIWORLD_CHANNEL_URL"] == f"operator://{FULLNAME}.{RELEASE_NAMESPACE}.svc:9443"
    assert env["MULTIWORLD_CHANNEL_PORT"] == "9443"
    assert {"name": "channel", "containerPort": 9443, "protocol": "TCP"} in container(rendered)["ports"]


@BOTH_MODES
def test_every_replica_reads_one_world_key_and_no_other_secret(
    render: Callable[..., Rendered], values: dict[str, Any]
) -> None:
    """Issue 32 finding 5: every world's secrets derive from one key, the same on every replica
    and after a restart: the Secret the chart makes empty (the operator writes the key into it,
    and an upgrade keeps it), in the release's namespace, which the operator may read and fill
    and no other Secret through this Role."""
    rendered = render(values)
    name = f"{FULLNAME}-world-key"
    secret = rendered.one("Secret", name, RELEASE_NAMESPACE)
    assert "data" not in secret and "stringData" not in secret
    env = {e["name"]: e.get("value") for e in container(rendered)["env"]}
    assert env[ENV_WORLD_KEY_SECRET] == name
    assert "POD_NAMESPACE" in env  # where the operator looks for it
    role = rendered.one("Role", name, RELEASE_NAMESPACE)
    assert granted(role) == grants("", ["secrets"], ["get", "update"])
    assert [r["resourceNames"] for r in role["rules"]] == [[name]]
    binding = rendered.one("RoleBinding", name, RELEASE_NAMESPACE)
    assert binding["roleRef"]["name"] == name and binding["subjects"] == [operator_subject()]


@BOTH_MODES
def test_deployment_runs_hardened_operators(render: Callable[..., Rendered], values: dict[str, Any]) -> None:
    rendered = render(values)
    deployment = rendered.one("Deployment", FULLNAME, RELEASE_NAMESPACE)
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == FULLNAME
    assert rendered.one("ServiceAccount", FULLNAME, RELEASE_NAMESPACE)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    main = container(rendered)
    security = main["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == 10001
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert main["resources"]["requests"] and main["resources"]["limits"]
    probe = main["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports[probe["port"]] == 8080
    assert main["args"][:2] == ["--liveness", "http://0.0.0.0:8080/healthz"]
    scratch = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    assert scratch == {"tmp": "/tmp"}


def test_image_and_health_port_come_from_values(chart: helm.Chart, render: Callable[..., Rendered]) -> None:
    default_image = f"{chart.values['image']['repository']}:{chart.metadata['appVersion']}"
    assert container(render())["image"] == default_image
    main = container(
        render(
            {
                "image": {"repository": "registry.example/mw-op", "tag": "1.2.3", "pullPolicy": "Always"},
                "healthPort": 9090,
                "logLevel": "DEBUG",
            }
        )
    )
    assert main["image"] == "registry.example/mw-op:1.2.3"
    assert main["imagePullPolicy"] == "Always"
    assert main["args"][:2] == ["--liveness", "http://0.0.0.0:9090/healthz"]
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"health": 9090, "channel": 7443, "webhook": 9443, "metrics": 8000}
    assert {"name": "MULTIWORLD_LOG_LEVEL", "value": "DEBUG"} in main["env"]


def test_app_version_is_the_project_version(chart: helm.Chart) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart.metadata["appVersion"] == project["version"]


@pytest.mark.parametrize(
    ("values", "namespaces"),
    [
        ({}, [RELEASE_NAMESPACE]),
        (NAMESPACED, NAMESPACED["watchNamespaces"]),
        ({"workers": {"create": True, "serviceAccountName": "trainer", "namespaces": ["jobs"]}}, ["jobs"]),
    ],
    ids=["release-namespace", "watched-namespaces", "explicit-namespaces"],
)
def test_workers_get_a_service_account_with_no_permission_where_multiworlds_run(
    render: Callable[..., Rendered], values: dict[str, Any], namespaces: list[str]
) -> None:
    rendered = render(values)
    name = values.get("workers", {}).get("serviceAccountName", "multiworld-worker")
    for namespace in namespaces:
        assert rendered.one("ServiceAccount", name, namespace)["automountServiceAccountToken"] is False
    # A worker needs no Kubernetes permission: nothing binds its ServiceAccount to any role.
    bindings = rendered.of_kind("RoleBinding") + rendered.of_kind("ClusterRoleBinding")
    assert [b for b in bindings if any(s.get("name") == name for s in b["subjects"])] == []
    assert [r for r in rendered.of_kind("Role") if r["metadata"]["name"] == name] == []
    assert sorted(
        sa["metadata"]["namespace"] for sa in rendered.of_kind("ServiceAccount") if sa["metadata"]["name"] == name
    ) == sorted(namespaces)
    assert f"serviceAccountName: {name}" in rendered.notes
    assert "kubectl get mw" in rendered.notes
    assert "kubectl apply" in rendered.notes


def test_workers_create_false_renders_no_worker_objects(render: Callable[..., Rendered]) -> None:
    rendered = render({"workers": {"create": False, "serviceAccountName": "multiworld-worker", "namespaces": []}})
    names = {obj["metadata"]["name"] for obj in rendered.objects}
    assert "multiworld-worker" not in names
    assert "multiworld-worker" in rendered.notes


NO_ELECTION = {"leaderElection": {"enabled": False, "leaseDuration": 15}}
# The grants of leader election, in the release namespace: the Lease named like the release
# (created by whichever replica comes first), and the leader label on the replicas' own pods.
LEADER_ELECTION = {("coordination.k8s.io", "leases", "create"), ("", "pods", "patch")}
LEASE_BY_NAME = grants("coordination.k8s.io", ["leases"], ["get", "update"])


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@BOTH_MODES
def test_two_replicas_elect_a_leader_on_a_lease_by_default(
    render: Callable[..., Rendered], values: dict[str, Any]
) -> None:
    rendered = render(values)
    spec = rendered.one("Deployment", FULLNAME, RELEASE_NAMESPACE)["spec"]
    assert spec["replicas"] == 2
    # A new pod stands by before an old one, which hands the Lease over as it stops, goes.
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    main = container(rendered)
    assert "--leader-election" in main["args"]
    assert flag(main["args"], "--lease-namespace") == RELEASE_NAMESPACE
    assert flag(main["args"], "--lease-name") == FULLNAME
    assert flag(main["args"], "--lease-duration") == "15"
    downward = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in main["env"] if "valueFrom" in e}
    assert downward == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}

    role = rendered.one("Role", f"{FULLNAME}-leader-election", RELEASE_NAMESPACE)
    assert granted(role) == LEADER_ELECTION | LEASE_BY_NAME
    (by_name,) = [rule for rule in role["rules"] if "resourceNames" in rule]
    assert (by_name["resourceNames"], set(by_name["verbs"])) == ([FULLNAME], {"get", "update"})
    binding = rendered.one("RoleBinding", f"{FULLNAME}-leader-election", RELEASE_NAMESPACE)
    assert binding["roleRef"]["name"] == f"{FULLNAME}-leader-election"
    assert binding["subjects"] == [operator_subject()]

    selector = spec["selector"]["matchLabels"]
    budget = rendered.one("PodDisruptionBudget", FULLNAME, RELEASE_NAMESPACE)["spec"]
    # maxUnavailable, not minAvailable 1: a node drain may evict even a lone replica.
    assert budget == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    (term,) = spec["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": selector},
    }
    # The logs worth reading are the leader's.
    assert f"kubectl logs -n {RELEASE_NAMESPACE} -l multiworld.io/operator-leader=true" in rendered.notes


def test_without_leader_election_one_replica_is_recreated(render: Callable[..., Rendered]) -> None:
    rendered = render({"replicas": 1, **NO_ELECTION, "affinity": {"nodeAffinity": {}}})
    spec = rendered.one("Deployment", FULLNAME, RELEASE_NAMESPACE)["spec"]
    assert (spec["replicas"], spec["strategy"]) == (1, {"type": "Recreate"})
    assert not [arg for arg in container(rendered)["args"] if arg.startswith("--lease") or "leader" in arg]
    assert [r for r in rendered.of_kind("Role") if "leader" in r["metadata"]["name"]] == []
    # The affinity of the values replaces the spreading of replicas.
    assert spec["template"]["spec"]["affinity"] == {"nodeAffinity": {}}


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"replicas": 2, **NO_ELECTION}, "/replicas"),
        ({"leaderElection": {"enabled": True, "leaseDuration": 1}}, "/leaderElection/leaseDuration"),
        ({"replicas": "one"}, "/replicas"),
        ({"replica": 1}, "replica"),
        ({"image": {"repository": "x", "tag": "1", "pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"workers": {"create": True, "serviceAccountName": "w", "namespaces": [], "extra": 1}}, "extra"),
        ({"watchNamespaces": ["Not_A_Namespace"]}, "/watchNamespaces/0"),
        ({"logLevel": "LOUD"}, "/logLevel"),
        ({"webhook": {**WEBHOOK_DEFAULTS, "failurePolicy": "Sometimes"}}, "/webhook/failurePolicy"),
        ({"webhook": {**WEBHOOK_DEFAULTS, "timeoutSeconds": 31}}, "/webhook/timeoutSeconds"),
        ({"webhook": {**WEBHOOK_DEFAULTS, "port": 0}}, "/webhook/port"),
        ({"webhook": {**WEBHOOK_DEFAULTS, "caBundle": "x"}}, "caBundle"),
    ],
    ids=[
        "replicas-without-election",
        "lease-too-short",
        "replicas-not-integer",
        "unknown-key",
        "bad-pull-policy",
        "unknown-nested-key",
        "bad-namespace",
        "bad-log-level",
        "bad-webhook-failure-policy",
        "webhook-timeout-over-30",
        "bad-webhook-port",
        "unknown-webhook-key",
    ],
)
def test_schema_refuses_bad_values_naming_them(
    chart: helm.Chart, render: Callable[..., Rendered], values: dict[str, Any], named: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(chart.merge_values(values))
    assert named in str(refused.value)
    with pytest.raises(helm.HelmValuesError) as refused_at_render:
        render(values)
    assert named in str(refused_at_render.value)


def test_schema_accepts_the_defaults_and_both_modes(chart: helm.Chart) -> None:
    chart.validate_schema(chart.merge_values({}))
    chart.validate_schema(chart.merge_values(NAMESPACED))
    chart.validate_schema(chart.merge_values({"replicas": 0}))
    chart.validate_schema(chart.merge_values({"replicas": 3}))
    chart.validate_schema(chart.merge_values({"replicas": 1, **NO_ELECTION}))


def test_example_manifests_run_as_the_workers_service_account(chart: helm.Chart) -> None:
    default_account = chart.values["workers"]["serviceAccountName"]
    templates = example_pod_templates()
    assert templates
    for example, template in templates:
        assert template["spec"].get("serviceAccountName") == default_account, example


# -- the admission webhook ----------------------------------------------------------------------


def webhook_args(rendered: Rendered) -> dict[str, str]:
    args = container(rendered)["args"]
    return {arg: args[i + 1] for i, arg in enumerate(args) if arg.startswith("--webhook-")}


def test_webhook_asks_the_operator_about_multiworld_creates_and_updates_only(
    chart: helm.Chart, render: Callable[..., Rendered]
) -> None:
    assert chart.values["webhook"] == WEBHOOK_DEFAULTS
    rendered = render()
    configuration = rendered.one("ValidatingWebhookConfiguration", FULLNAME)
    (webhook,) = configuration["webhooks"]
    assert webhook["rules"] == [
        {
            "apiGroups": ["multiworld.io"],
            "apiVersions": ["*"],
            "resources": ["multiworlds"],
            "operations": ["CREATE", "UPDATE"],
            "scope": "Namespaced",
        }
    ]
    assert (webhook["failurePolicy"], webhook["timeoutSeconds"], webhook["sideEffects"]) == ("Fail", 5, "None")
    assert "namespaceSelector" not in webhook
    # No caBundle: the operator writes it (and Helm leaves a field it never set alone).
    service = webhook["clientConfig"]["service"]
    assert webhook["clientConfig"].keys() == {"service"}
    assert service["path"] == f"/{HANDLER_ID}"
    # The Service leads to the operator's webhook port, whose certificate names the Service.
    svc = rendered.one("Service", service["name"], service["namespace"])
    assert service["namespace"] == RELEASE_NAMESPACE
    (port,) = svc["spec"]["ports"]
    assert port["port"] == service["port"]
    assert (
        svc["spec"]["selector"]
        == rendered.one("Deployment", FULLNAME, RELEASE_NAMESPACE)["spec"]["selector"]["matchLabels"]
    )
    ports = {p["name"]: p["containerPort"] for p in container(rendered)["ports"]}
    assert ports[port["targetPort"]] == 9443
    assert webhook_args(rendered) == {
        "--webhook-port": "9443",
        "--webhook-host": f"{service['name']}.{RELEASE_NAMESPACE}.svc",
        "--webhook-configuration": FULLNAME,
    }
    # The operator may write only this configuration.
    rules = rendered.one("ClusterRole", FULLNAME)["rules"]
    (rule,) = [r for r in rules if "validatingwebhookconfigurations" in r["resources"]]
    assert rule["resourceNames"] == [FULLNAME]


def test_webhook_values_reach_the_configuration_and_the_operator(render: Callable[..., Rendered]) -> None:
    values = {"webhook": {"enabled": True, "failurePolicy": "Ignore", "port": 10443, "timeoutSeconds": 2}}
    rendered = render({**values, **NAMESPACED})
    (webhook,) = rendered.one("ValidatingWebhookConfiguration", FULLNAME)["webhooks"]
    assert (webhook["failurePolicy"], webhook["timeoutSeconds"]) == ("Ignore", 2)
    # Watching a list of namespaces, it is asked about those only.
    assert webhook["namespaceSelector"] == {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": NAMESPACED["watchNamespaces"]}
        ]
    }
    assert webhook_args(rendered)["--webhook-port"] == "10443"
    assert {p["name"]: p["containerPort"] for p in container(rendered)["ports"]}["webhook"] == 10443


def test_webhook_disabled_renders_no_webhook_objects_args_or_rights(render: Callable[..., Rendered]) -> None:
    rendered = render({"webhook": {**WEBHOOK_DEFAULTS, "enabled": False}})
    assert rendered.of_kind("ValidatingWebhookConfiguration") == []
    # The worker channel's and the metrics' Services.
    assert sorted(s["metadata"]["name"] for s in rendered.of_kind("Service")) == [FULLNAME, f"{FULLNAME}-metrics"]
    assert webhook_args(rendered) == {}
    assert [p["name"] for p in container(rendered)["ports"]] == ["health", "channel", "metrics"]
    assert granted(rendered.one("ClusterRole", FULLNAME)) == OPERATOR_IN_NAMESPACE | KOPF_CLUSTER_READS


def test_every_replica_serves_one_certificate_and_is_ready_once_it_can_admit(render: Callable[..., Rendered]) -> None:
    """Issue 32 finding 1: the default two replicas read one certificate Secret (the first makes
    it: create; then only that Secret may be read and replaced), and a replica is ready only once
    its webhook listens, which it does once the caBundle trusts its certificate: `helm install
    --wait` returns when admission works, and a rollout sends no request to a replica that cannot
    answer it."""
    rendered = render()
    assert rendered.one("Deployment", FULLNAME, RELEASE_NAMESPACE)["spec"]["replicas"] == 2
    assert container(rendered)["readinessProbe"]["tcpSocket"] == {"port": "webhook"}
    name = f"{FULLNAME}-webhook-tls"
    assert name == secret_name(FULLNAME)
    role = rendered.one("Role", name, RELEASE_NAMESPACE)
    assert granted(role) == grants("", ["secrets"], ["create", "get", "update"])
    assert [r["resourceNames"] for r in role["rules"] if "get" in r["verbs"]] == [[name]]
    binding = rendered.one("RoleBinding", name, RELEASE_NAMESPACE)
    assert binding["roleRef"]["name"] == name and binding["subjects"] == [operator_subject()]
    without = render({"webhook": {**WEBHOOK_DEFAULTS, "enabled": False}})
    assert "readinessProbe" not in container(without)
    assert name not in [r["metadata"]["name"] for r in without.of_kind("Role")]
