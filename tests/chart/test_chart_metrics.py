"""The chart's Prometheus side: the operator serves metrics on a port its Deployment declares, a
Service reaches every replica (the standby too), a ServiceMonitor and a Grafana dashboard come
on request, and every query of the dashboard runs on a real Prometheus scraping two replicas."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import helm_python as helm
import pytest

from multiworld_operator.kube.admission.certificate import secret_name
from multiworld_operator.kube.metrics.registry import OperatorMetrics
from multiworld_operator.local.store_ports import free_store_ports
from tests.support.chart_support import CHART_DIR, FULLNAME, RELEASE_NAMESPACE, Manifest, Rendered
from tests.support.dashboard import dashboard, panels, queries, substituted, variables
from tests.support.operator_metrics import T0, FixedStatuses, failure, planner_status
from tests.support.prometheus import Prometheus, PrometheusError

METRICS_SERVICE = f"{FULLNAME}-metrics"
LEADER_LABEL = "multiworld.io/operator-leader"
GRAFANA_SIDECAR = {"grafana_dashboard": "1"}
ENABLED = {
    "metrics": {
        "port": 9100,
        "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kube-prometheus-stack"}},
        "dashboard": {"enabled": True, "labels": {"grafana_dashboard": "multiworld"}},
    }
}

# The metric names the operator and the workers export (a histogram as its three series): a
# query of the dashboard naming any other one would stay empty forever.
HISTOGRAMS = {
    "multiworld_world_recovery_seconds",
    "multiworld_operator_step_duration_seconds",
    "multiworld_worker_op_duration_seconds",
}
METRICS = {
    "multiworld_world_phase",
    "multiworld_world_epoch",
    "multiworld_world_ranks",
    "multiworld_world_ranks_ready",
    "multiworld_world_restarts_total",
    "multiworld_world_failures_total",
    "multiworld_phase",
    "multiworld_spares_ready",
    "multiworld_spares_wanted",
    "multiworld_rollout_pods_updated",
    "multiworld_rollout_pods",
    "multiworld_operator_api_errors_total",
    "multiworld_operator_multiworlds_waiting",
    "multiworld_operator_leader",
    "multiworld_worker_ops_total",
    "multiworld_worker_breaks_total",
    "multiworld_worker_joins_total",
    "multiworld_worker_heartbeat_misses_total",
} | {f"{name}_{suffix}" for name in HISTOGRAMS for suffix in ("bucket", "sum", "count")}


def container(rendered: Rendered) -> Manifest:
    deployment = rendered.one("Deployment", FULLNAME, RELEASE_NAMESPACE)
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def dashboard_queries() -> list[Any]:
    return [pytest.param(expr, id=where) for where, expr in queries()]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bmultiworld_\w+", expr))


# What the dashboard is checked against: two replicas of the operator, each its real metrics
# (multiworld_operator.kube.metrics.registry) on its real endpoint, and a worker's real metrics
# (multiworld.metrics) in a process of its own. The leader counted a failure of world w1 of
# MultiWorld team-a/trainer and its recovery; the standby shows the statuses from its watch, a
# step behind. The dashboard must show one view of each world: the leader's.
KEY = ("team-a", "trainer")
# The worker: one world w1, four all_reduce done, one join, one break, one heartbeat missed.
WORKER = """
import sys, time
from multiworld import metrics
metrics.serve(int(sys.argv[1]))
ops = metrics.recorder("w1")
for _ in range(4):
    ops.done("all_reduce", ops.issued("all_reduce"))
metrics.world_joined("w1")
metrics.world_broke("w1")
metrics.heartbeat_missed("w1")
print("serving", flush=True)
time.sleep(3600)
"""


def operator_replica(leading: bool) -> str:
    """A replica's metrics endpoint (host:port)."""
    metrics = OperatorMetrics()
    if leading:
        running = planner_status(w1={"phase": "Running", "epoch": 1, "readyRanks": 2})
        failed = planner_status(w1={"phase": "Recovering", "epoch": 2, "restarts": 1, "lastFailure": failure(1)})
        back = planner_status(
            w1={"phase": "Running", "epoch": 2, "restarts": 1, "readyRanks": 2, "lastFailure": failure(1),
                "formedAt": (T0 + timedelta(seconds=4)).isoformat()},
        )  # fmt: skip
        metrics.step_taken(KEY, running, failed)
        metrics.step_taken(KEY, failed, back)
        metrics.api_error("patch_namespaced_config_map", "409")
        metrics.step_duration.observe(0.05)
        shown = {**back.view(), "phase": "Running", "spares": {"m": "1/1"}, "rollout": {"m": "1/2"}}
    else:
        shown = planner_status(w1={"phase": "Pending", "epoch": 1}).view()
    metrics.read_statuses_from(FixedStatuses({KEY: shown}, leading=leading))
    return f"127.0.0.1:{metrics.serve(0)}"


@contextmanager
def worker_process() -> Iterator[str]:
    """A process serving a worker's metrics; its host:port."""
    (port,) = free_store_ports(1)
    process = subprocess.Popen([sys.executable, "-c", WORKER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "serving"
        yield f"127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def prometheus() -> Iterator[Prometheus]:
    with worker_process() as worker, Prometheus([operator_replica(True), operator_replica(False), worker]) as started:
        # Two scrapes of each target: what a rate() needs.
        started.wait_for(
            "count_over_time(up[1h])",
            lambda result: len(result) == 3 and all(float(r["value"][1]) >= 2 for r in result),
        )
        yield started


# -- the operator's metrics endpoint and Service --------------------------------------------------


def test_defaults_serve_metrics_through_a_service_with_no_monitor_or_dashboard(
    chart: helm.Chart, render: Callable[..., Rendered]
) -> None:
    assert chart.values["metrics"] == {
        "port": 8000,
        "secure": True,
        "serviceMonitor": {"enabled": False, "interval": "30s", "labels": {}},
        "dashboard": {"enabled": False, "labels": GRAFANA_SIDECAR},
    }
    rendered = render()
    main = container(rendered)
    assert main["args"][main["args"].index("--metrics-port") + 1] == "8000"
    # The health port stays the first (tests/kube reads it there).
    assert main["ports"][0]["name"] == "health"
    assert {"name": "metrics", "containerPort": 8000, "protocol": "TCP"} in main["ports"]
    service = rendered.one("Service", METRICS_SERVICE, RELEASE_NAMESPACE)
    assert service["spec"]["ports"] == [{"name": "metrics", "protocol": "TCP", "port": 8000, "targetPort": "metrics"}]
    assert rendered.of_kind("ServiceMonitor") == []
    assert rendered.of_kind("ConfigMap") == []
    assert f"through the Service\n{METRICS_SERVICE}" in rendered.notes


def test_the_metrics_service_selects_every_replica_not_only_the_leader(render: Callable[..., Rendered]) -> None:
    rendered = render()
    deployment = rendered.one("Deployment", FULLNAME, RELEASE_NAMESPACE)
    assert deployment["spec"]["replicas"] == 2
    selector = rendered.one("Service", METRICS_SERVICE, RELEASE_NAMESPACE)["spec"]["selector"]
    standby = deployment["spec"]["template"]["metadata"]["labels"]
    leader = {**standby, LEADER_LABEL: "true"}
    for pod in (standby, leader):
        assert selector.items() <= pod.items()
    # The worker channel's Service, by contrast, reaches the leader only.
    channel = rendered.one("Service", FULLNAME, RELEASE_NAMESPACE)["spec"]["selector"]
    assert not channel.items() <= standby.items()


def test_the_metrics_port_comes_from_values(render: Callable[..., Rendered]) -> None:
    rendered = render(ENABLED)
    main = container(rendered)
    assert main["args"][main["args"].index("--metrics-port") + 1] == "9100"
    assert {p["name"]: p["containerPort"] for p in main["ports"]}["metrics"] == 9100
    (port,) = rendered.one("Service", METRICS_SERVICE, RELEASE_NAMESPACE)["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (9100, "metrics")


# -- the ServiceMonitor and the dashboard's ConfigMap -----------------------------------------------


def test_the_service_monitor_scrapes_the_metrics_service_only(render: Callable[..., Rendered]) -> None:
    rendered = render(ENABLED)
    monitor = rendered.one("ServiceMonitor", FULLNAME, RELEASE_NAMESPACE)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = monitor["spec"]
    # honorLabels: the metrics' own `namespace` (the MultiWorld's) is not renamed exported_namespace.
    (endpoint,) = spec["endpoints"]
    assert endpoint.items() >= {"port": "metrics", "path": "/metrics", "interval": "15s", "honorLabels": True}.items()
    wanted = spec["selector"]["matchLabels"]
    selected = [
        s["metadata"]["name"] for s in rendered.of_kind("Service") if wanted.items() <= s["metadata"]["labels"].items()
    ]
    assert selected == [METRICS_SERVICE]


# -- who may read them (issue 32, finding 6) --------------------------------------------------------

READER_ROLE = f"{FULLNAME}-metrics-reader"
TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def operator_may_review(rendered: Rendered) -> set[tuple[str, str, str]]:
    """The reviews the operator's ClusterRole lets it create."""
    rules = rendered.one("ClusterRole", FULLNAME)["rules"]
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        if resource in ("tokenreviews", "subjectaccessreviews")
    }


REVIEWS = {
    ("authentication.k8s.io", "tokenreviews", "create"),
    ("authorization.k8s.io", "subjectaccessreviews", "create"),
}


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a"]}], ids=["all-namespaces", "namespaced"])
def test_by_default_metrics_are_for_a_token_allowed_to_get_them(
    render: Callable[..., Rendered], values: dict[str, Any]
) -> None:
    """As controller-runtime's default: the operator serves HTTPS and checks each token with a
    TokenReview and a SubjectAccessReview, which its ClusterRole lets it create (both modes);
    the ClusterRole that allows get on /metrics is the chart's, for users to bind to their
    Prometheus (the chart binds it to nobody)."""
    rendered = render(values)
    assert "--no-metrics-secure" not in container(rendered)["args"]
    assert operator_may_review(rendered) == REVIEWS
    reader = rendered.one("ClusterRole", READER_ROLE)
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    bindings = rendered.of_kind("ClusterRoleBinding") + rendered.of_kind("RoleBinding")
    assert [b for b in bindings if b["roleRef"]["name"] == READER_ROLE] == []
    assert f"--clusterrole={READER_ROLE}" in rendered.notes


def test_the_service_monitor_bears_prometheus_token_and_trusts_the_webhook_certificate(
    render: Callable[..., Rendered],
) -> None:
    """Every replica shows the webhook's certificate (made for the webhook Service's name, its
    CAs in the webhook Secret's ca.crt): the ServiceMonitor verifies it by that name and CA, and
    sends the token of Prometheus's own ServiceAccount. Without the webhook, each replica's
    certificate is its own, self-signed: not verified."""
    rendered = render(ENABLED)
    (endpoint,) = rendered.one("ServiceMonitor", FULLNAME, RELEASE_NAMESPACE)["spec"]["endpoints"]
    args = container(rendered)["args"]
    assert endpoint["scheme"] == "https"
    assert endpoint["bearerTokenFile"] == TOKEN_FILE
    assert endpoint["tlsConfig"] == {
        "serverName": args[args.index("--webhook-host") + 1],
        "ca": {"secret": {"name": secret_name(args[args.index("--webhook-configuration") + 1]), "key": "ca.crt"}},
    }
    without_webhook = render({**ENABLED, "webhook": {"enabled": False, "failurePolicy": "Fail", "port": 9443,
                                                     "timeoutSeconds": 5}})  # fmt: skip
    (endpoint,) = without_webhook.one("ServiceMonitor", FULLNAME, RELEASE_NAMESPACE)["spec"]["endpoints"]
    assert (endpoint["scheme"], endpoint["bearerTokenFile"]) == ("https", TOKEN_FILE)
    assert endpoint["tlsConfig"] == {"insecureSkipVerify": True}


def test_metrics_secure_false_serves_plain_http_and_grants_no_reviews_of_access(
    render: Callable[..., Rendered],
) -> None:
    plain = {"metrics": {**ENABLED["metrics"], "secure": False}}
    rendered = render(plain)
    assert "--no-metrics-secure" in container(rendered)["args"]
    assert [r for r in rendered.of_kind("ClusterRole") if r["metadata"]["name"] == READER_ROLE] == []
    # TokenReviews stay: they check which pod a worker channel connection speaks for.
    assert operator_may_review(rendered) == {("authentication.k8s.io", "tokenreviews", "create")}
    (endpoint,) = rendered.one("ServiceMonitor", FULLNAME, RELEASE_NAMESPACE)["spec"]["endpoints"]
    assert not {"scheme", "bearerTokenFile", "tlsConfig"} & endpoint.keys()
    assert "plain HTTP to anyone" in rendered.notes


def test_the_dashboard_config_map_carries_the_dashboard_and_the_sidecar_labels(
    render: Callable[..., Rendered],
) -> None:
    rendered = render(ENABLED)
    config_map = rendered.one("ConfigMap", f"{FULLNAME}-dashboard", RELEASE_NAMESPACE)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "multiworld"
    assert json.loads(config_map["data"]["multiworld.json"]) == dashboard()
    default_labels = {"metrics": {**ENABLED["metrics"], "dashboard": {"enabled": True, "labels": GRAFANA_SIDECAR}}}
    labels = render(default_labels).one("ConfigMap", f"{FULLNAME}-dashboard", RELEASE_NAMESPACE)["metadata"]["labels"]
    assert labels.items() >= GRAFANA_SIDECAR.items()


def test_lint_is_clean_with_the_monitor_and_the_dashboard() -> None:
    report = helm.lint(CHART_DIR, ENABLED, strict=True, namespace=RELEASE_NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(
    ("metrics", "named"),
    [
        ({**ENABLED["metrics"], "prot": 8000}, "prot"),
        ({**ENABLED["metrics"], "port": 0}, "/metrics/port"),
        ({**ENABLED["metrics"], "secure": "yes"}, "/metrics/secure"),
        ({**ENABLED["metrics"], "serviceMonitor": {"enabled": True, "interval": "soon", "labels": {}}}, "interval"),
        (
            {**ENABLED["metrics"], "dashboard": {"enabled": True, "labels": {"grafana_dashboard": 1}}},
            "grafana_dashboard",
        ),
    ],
    ids=["unknown-key", "bad-port", "not-a-boolean", "bad-interval", "label-not-a-string"],
)
def test_schema_refuses_bad_metrics_values(
    chart: helm.Chart, render: Callable[..., Rendered], metrics: dict[str, Any], named: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(chart.merge_values({"metrics": metrics}))
    assert named in str(refused.value)
    with pytest.raises(helm.HelmValuesError):
        render({"metrics": metrics})


# -- the dashboard --------------------------------------------------------------------------------


def test_the_dashboard_is_valid_with_unique_panel_ids_and_titles() -> None:
    assert dashboard()["uid"] and len(dashboard()["uid"]) <= 40
    ids = [p["id"] for p in dashboard()["panels"]]
    titles = [p["title"] for p in dashboard()["panels"]]
    assert len(set(ids)) == len(ids)
    assert all(titles) and len(set(titles)) == len(titles)
    for panel in panels():
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys(), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
    assert {"namespace", "multiworld"} <= variables().keys()


def test_the_dashboard_shows_what_its_users_look_for() -> None:
    shown = {name for panel in panels() for target in panel["targets"] for name in metric_names(target["expr"])}
    assert shown >= {
        "multiworld_world_phase",
        "multiworld_world_restarts_total",
        "multiworld_world_recovery_seconds_bucket",
        "multiworld_world_ranks_ready",
        "multiworld_world_ranks",
        "multiworld_world_failures_total",
        "multiworld_operator_api_errors_total",
        "multiworld_operator_step_duration_seconds_bucket",
        "multiworld_operator_leader",
        "multiworld_worker_op_duration_seconds_bucket",
    }
    recovery = [t["expr"] for p in panels() for t in p["targets"] if "recovery_seconds" in t["expr"]]
    quantiles = {q for expr in recovery for q in re.findall(r"histogram_quantile\((0\.\d+)", expr)}
    assert quantiles >= {"0.5", "0.99"}


@pytest.mark.parametrize("expr", dashboard_queries())
def test_every_dashboard_query_runs_on_the_scraped_metrics(prometheus: Prometheus, expr: str) -> None:
    assert metric_names(expr) <= METRICS, f"unknown metrics in {expr!r}"
    query = substituted(expr)
    assert "$" not in query and "[[" not in query
    # Raises PrometheusError with Prometheus's words if refused; empty, the panel would show nothing.
    assert prometheus.query(query), query


def panel_query(title: str) -> str:
    (panel,) = [p for p in panels() if p["title"] == title]
    return substituted(panel["targets"][0]["expr"])


def test_the_dashboard_shows_the_leaders_view_and_both_replicas(prometheus: Prometheus) -> None:
    (world,) = prometheus.query(panel_query("World phase"))
    assert world["metric"] == {"namespace": "team-a", "multiworld": "trainer", "world": "w1", "phase": "Running"}
    (multiworld,) = prometheus.query(panel_query("MultiWorld phase"))
    assert multiworld["metric"]["phase"] == "Running"
    (restarts,) = prometheus.query(panel_query("Restarts over the range"))
    assert restarts["metric"] == {"namespace": "team-a", "multiworld": "trainer", "world": "w1"}
    leaders = prometheus.query(panel_query("Leader"))
    assert sorted(r["value"][1] for r in leaders) == ["0", "1"]


def test_the_harness_names_what_prometheus_refuses(prometheus: Prometheus) -> None:
    with pytest.raises(PrometheusError, match="parse error"):
        prometheus.query("rate(multiworld_phase[")
    assert prometheus.query("1 + 1")[0]["value"][1] == "2"
