"""The user journeys on a real node: the chart installed with Helm runs our operator image as a
Deployment, `kubectl apply` of examples/all_gather/multiworld.yaml starts real pods of our worker
image, and failures are made the way they happen (a process killed or frozen through the
container runtime, a pod deleted with kubectl, the operator's own pod deleted mid-recovery).
Every check reads what a user would: kubectl, pod logs, pod uids, the MultiWorld's status."""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from multiworld_operator.kube.admission.certificate import secret_name
from tests.cluster.cluster import Cluster, ClusterError
from tests.cluster.node import GPU_RESOURCE, GPUS_PER_NODE
from tests.support.dashboard import queries, substituted
from tests.support.metrics_support import service_account_token
from tests.support.node_support import (
    WAIT_S,
    WORKER_IMAGE,
    Operator,
    applied,
    example_manifest,
    kubectl,
    operator_pods,
    ready_operator_pod,
    signal_container,
    wait_running,
)
from tests.support.operator_support import WORKER_SA, KubeNamespace, wait_for
from tests.support.prometheus import Prometheus

pytestmark = [pytest.mark.kube, pytest.mark.node]

REPO = Path(__file__).resolve().parents[2]
EXCLUSIVE = {"world1": ("w1-0", "w1-1"), "world2": ("w2-0", "w2-1")}
# The chart's liveness probe: initialDelaySeconds + failureThreshold x periodSeconds, and a tick.
LIVENESS_PROVEN_S = 10 + 3 * 20 + 5
BENCH_RUN_S = 600
# The chart's default metrics.port.
OPERATOR_METRICS_PORT = 8000


@pytest.fixture
def all_gather(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[str]:
    """examples/all_gather applied under the test's own name, Running with both worlds at epoch 1
    and the leader stepping in both (its log shows them); deleted afterwards (and its pods gone,
    so the next test has the node's cores)."""
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.removeprefix("test_").lower())[:40].strip("-")
    with applied(kube_node, operator, kube, example_manifest("all_gather", name, tmp_path), name):
        wait_running(kube, name, {"world1": 1, "world2": 1})
        # Stepping in both worlds: a failure now breaks worlds in use (before its first step, the
        # leader would take world1 up at its new epoch without ever seeing it break).
        for world in ("world1", "world2"):
            _wait_log(kube_node, operator, f"{name}-leader-0", f"rank: 0 from {world} has gathered tensors: ")
        yield name


def _wait_rollout_complete(kube: KubeNamespace, name: str, what: str) -> dict[str, Any]:
    """The status once the rollout is complete (Progressing: RolloutComplete) and every world runs."""

    def complete() -> dict[str, Any] | None:
        status = kube.status(name)
        progressing = {c["type"]: c for c in status.get("conditions", [])}.get("Progressing")
        done = progressing is not None and progressing["reason"] == "RolloutComplete"
        return status if done and status.get("phase") == "Running" else None

    return wait_for(f"the rollout of {what} complete", complete, WAIT_S)


def _logs(cluster: Cluster, operator: Operator, pod: str) -> str:
    return kubectl(cluster, "logs", "-n", operator.apps, pod)


def _wait_log(cluster: Cluster, operator: Operator, pod: str, line: str) -> str:
    def logged() -> str | None:
        text = _logs(cluster, operator, pod)
        return text if line in text else None

    try:
        return wait_for(f"{pod} to log {line!r}", logged, WAIT_S)
    except ClusterError as exc:
        lines = [
            x for x in _logs(cluster, operator, pod).splitlines() if "tensor" not in x and "done with step" not in x
        ]
        raise ClusterError(f"{exc}; its log without step lines ends:\n" + "\n".join(lines[-40:])) from None


def _member(name: str, pod: str) -> str:
    return pod.removeprefix(f"{name}-")


@dataclass(frozen=True)
class DnsLog:
    """The cluster DNS's query log (tests/cluster/node_host.py), from where it was when the test
    began."""

    path: Path
    start: int

    def lines(self, containing: str) -> list[str]:
        with self.path.open(errors="replace") as log:
            log.seek(self.start)
            return [line for line in log.read().splitlines() if containing in line]


@pytest.fixture
def dns_log(kube_node: Cluster) -> DnsLog:
    """Asked for before the fixtures that start pods, so that it holds all they asked."""
    path = kube_node.logs / "dnsmasq.log"
    return DnsLog(path, path.stat().st_size)


def test_operator_runs_as_the_charts_deployment(kube_node: Cluster, operator: Operator) -> None:
    pod = ready_operator_pod(kube_node, operator)
    assert pod is not None
    assert pod.spec.service_account_name == operator.fullname
    (status,) = pod.status.container_statuses
    assert status.image == "docker.io/multiworld/operator:dev", status.image
    assert pod.spec.node_name in {node.name for node in kube_node.nodes}
    deployment = kubectl(kube_node, "get", "deployment", operator.fullname, "-n", operator.namespace, "-o", "json")
    assert json.loads(deployment)["status"].get("availableReplicas") == 1


def test_all_gather_runs_on_the_node(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, dns_log: DnsLog, all_gather: str
) -> None:
    """Every pod Running, spread over the session's nodes by the scheduler: the worlds' ranks
    talk across nodes. No pod asked the cluster's DNS for the name of a loopback address (the
    leader's own store clients, which connect to ::ffff:127.0.0.1, are answered from the
    /etc/hosts line the operator adds)."""
    name = all_gather
    pods = kube.pods(name)
    assert {_member(name, p) for p in pods} == {"leader-0", "w1-0", "w1-1", "w2-0", "w2-1"}
    assert all(p.status.phase == "Running" for p in pods.values())
    placed = {p.spec.node_name for p in pods.values()}
    assert placed == {node.name for node in kube_node.nodes}, placed
    row = kubectl(kube_node, "get", "mw", name, "-n", operator.apps, "--no-headers").split()
    assert row[:3] == [name, "Running", "2/2"], row
    ips = {p.status.pod_ip for p in pods.values()}
    asked = [line for line in dns_log.lines("query[PTR] 1.0.0.127.in-addr.arpa") if line.split()[-1] in ips]
    assert asked == [], asked[:4]


def _kill_and_check(
    cluster: Cluster,
    operator: Operator,
    kube: KubeNamespace,
    name: str,
    victim: str,
    how: str,
    epoch: int,
    replaced: tuple[str, ...],
) -> None:
    """Fail world1 through `victim` (`how`: SIGKILL through the runtime, or kubectl delete);
    exactly the `replaced` pods come back as new pods, world1 runs at `epoch`, world2 never
    notices."""
    before = kube.uids(name)
    pod = kube.pods(name)[f"{name}-{victim}"]
    if how == "kubectl delete":
        kubectl(cluster, "delete", "pod", pod.metadata.name, "-n", operator.apps, "--wait=false")
    else:
        signal_container(cluster, pod, how)
    wait_running(kube, name, {"world1": epoch, "world2": 1})
    after = kube.uids(name)
    assert set(after) == set(before)
    for member in ("leader-0", *EXCLUSIVE["world1"], *EXCLUSIVE["world2"]):
        changed = after[f"{name}-{member}"] != before[f"{name}-{member}"]
        assert changed == (member in replaced), f"{member}: replaced {changed}, expected {member in replaced}"
    _wait_log(cluster, operator, f"{name}-leader-0", f"world1 rejoined at epoch {epoch}")


def _assert_world2_untouched(cluster: Cluster, operator: Operator, kube: KubeNamespace, name: str) -> None:
    for member in ("leader-0", *EXCLUSIVE["world2"]):
        log = _logs(cluster, operator, f"{name}-{member}")
        assert "world2 broke" not in log, f"{member}:\n{log}"


@contextlib.contextmanager
def _prometheus(cluster: Cluster, operator: Operator, target: str, folder: Path) -> Iterator[Prometheus]:
    """A real Prometheus scraping `target` as the chart's ServiceMonitor has it scrape: over
    HTTPS, trusting the webhook Secret's ca.crt for the webhook Service's name (every replica
    shows the webhook's certificate), with the token of a ServiceAccount bound to the chart's
    metrics-reader ClusterRole, as Prometheus's own would be."""
    with (
        cluster.api_client() as api,
        service_account_token(api, operator.namespace, "prometheus", f"{operator.fullname}-metrics-reader") as token,
    ):
        secret = client.CoreV1Api(api).read_namespaced_secret(secret_name(operator.fullname), operator.namespace)
        deployment = client.AppsV1Api(api).read_namespaced_deployment(operator.fullname, operator.namespace)
        (container,) = deployment.spec.template.spec.containers
        (folder / "token").write_text(token)
        (folder / "ca.crt").write_bytes(base64.b64decode(secret.data["ca.crt"]))
        tls = {
            "ca_file": str(folder / "ca.crt"),
            "server_name": container.args[container.args.index("--webhook-host") + 1],
        }
        scrape = {"scheme": "https", "authorization": {"credentials_file": str(folder / "token")}, "tls_config": tls}
        with Prometheus([target], scrape=scrape) as prometheus:
            yield prometheus


def _single_value_is(expected: float, result: list[dict[str, Any]]) -> bool:
    return float(result[0]["value"][1]) == expected


def _assert_scraped(prometheus: Prometheus, operator: Operator, name: str, restarts: dict[str, int]) -> None:
    """Prometheus shows each world's restarts as its status does, one recovery sample per
    restart, and runs every query of the chart's dashboard (world panels with data)."""
    for world, count in restarts.items():
        labels = f'namespace="{operator.apps}",multiworld="{name}",world="{world}"'
        for metric, expected in (("multiworld_world_restarts_total", count),
                                 ("multiworld_world_recovery_seconds_count", count)):  # fmt: skip
            query = f"sum({metric}{{{labels}}}) or vector(0)"
            prometheus.wait_for(query, functools.partial(_single_value_is, expected), WAIT_S)
    answers = {where: prometheus.query(substituted(expr)) for where, expr in queries()}
    assert [where for where, answer in answers.items() if where.startswith("World phase") and not answer] == []


def test_killed_worker_costs_only_its_world(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, all_gather: str, tmp_path: Path
) -> None:
    """Only the dead pod is replaced (the default, `replace: Pod`): w1-0 joins world1's epoch 2
    in its own pod; a real Prometheus scraping the operator's pod counts world1's restart and its
    recovery, and answers every query of the chart's dashboard. Then world1's failure policy says
    `replace: World`: deleting w1-0 restarts both of world1's exclusive pods."""
    name = all_gather
    pod = ready_operator_pod(kube_node, operator)
    assert pod is not None
    with _prometheus(kube_node, operator, f"{pod.status.pod_ip}:{OPERATOR_METRICS_PORT}", tmp_path) as prometheus:
        _kill_and_check(kube_node, operator, kube, name, "w1-1", "SIGKILL", epoch=2, replaced=("w1-1",))
        _assert_scraped(prometheus, operator, name, {"world1": 1, "world2": 0})
    _wait_log(kube_node, operator, f"{name}-w1-0", "world1 rejoined at epoch 2")
    manifest = json.loads(kubectl(kube_node, "get", "mw", name, "-n", operator.apps, "-o", "json"))
    worlds = [
        {**w, "failurePolicy": {"replace": "World"}} if w["name"] == "world1" else w for w in manifest["spec"]["worlds"]
    ]
    kubectl(kube_node, "patch", "mw", name, "-n", operator.apps, "--type=merge",
            "-p", json.dumps({"spec": {"worlds": worlds}}))  # fmt: skip
    _kill_and_check(kube_node, operator, kube, name, "w1-0", "kubectl delete", epoch=3, replaced=EXCLUSIVE["world1"])
    _assert_world2_untouched(kube_node, operator, kube, name)
    described = kubectl(kube_node, "describe", "mw", name, "-n", operator.apps)
    events = described[described.index("Events:") :]
    assert events.count("WorldFailed") == 2 and events.count("WorldRecovered") == 2, events
    assert f"pod {name}-w1-0 (rank 1) was deleted; restarting at epoch 3" in events, events
    status = kube.status(name)
    assert status["worlds"]["world1"]["restarts"] == 2 and status["worlds"]["world2"]["restarts"] == 0
    shown = subprocess.run(
        [str(Path(sys.executable).with_name("multiworld")), "status", name, "-n", operator.apps,
         "--kubeconfig", str(kube_node.kubeconfig)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    rows = {line.split()[0]: line.split() for line in shown.splitlines() if line.startswith("world")}
    assert rows["world1"][:7] == ["world1", "Running", "3", "3/3", "2", "PodDeleted", f"{name}-w1-0"], shown
    assert rows["world2"] == ["world2", "Running", "1", "3/3", "0"], shown
    node_outcome = {w: (s["phase"], s["epoch"]) for w, s in status["worlds"].items()}

    # The same manifest and the same kill, run by `multiworld run` on this machine.
    manifest = tmp_path / "local.yaml"
    manifest.write_text((tmp_path / f"{name}.yaml").read_text())
    local = subprocess.run(
        [str(Path(sys.executable).with_name("multiworld")), "run", str(manifest), "--kill", "w1:1", "--after", "3",
         "--duration", "25", "--json", "--no-view", "--workdir", str(REPO)],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert local.returncode == 0, local.stderr
    summary = json.loads(local.stdout.strip().splitlines()[-1])["worlds"]
    assert {w: (s["phase"], s["epoch"]) for w, s in summary.items()} == {
        "world1": ("Running", 2),
        "world2": ("Running", 1),
    }
    assert summary["world2"]["errors"] == 0 and summary["world2"]["failures"] == 0
    assert node_outcome == {"world1": ("Running", 3), "world2": ("Running", 1)}


def test_frozen_worker_is_replaced(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, all_gather: str
) -> None:
    name = all_gather
    before = kube.uids(name)
    frozen = kube.pods(name)[f"{name}-w1-0"]
    signal_container(kube_node, frozen, "SIGSTOP")

    def reported() -> dict[str, Any] | None:
        failure = (kube.status(name).get("worlds") or {}).get("world1", {}).get("lastFailure") or {}
        return failure if failure.get("reason") == "WorldBroken" else None

    # A live member's report of world1 broken, over its channel, names the frozen rank.
    failure = wait_for("world1 failed on a live member's report", reported, WAIT_S)
    assert (failure["epoch"], failure["rank"], failure["pod"]) == (1, 1, f"{name}-w1-0"), failure
    wait_running(kube, name, {"world1": 2, "world2": 1})
    after = kube.uids(name)
    assert after[f"{name}-w1-0"] != before[f"{name}-w1-0"], "the frozen pod was not replaced"
    for member in ("leader-0", "w1-1", *EXCLUSIVE["world2"]):
        assert after[f"{name}-{member}"] == before[f"{name}-{member}"], f"{member} was replaced"
    replaced = " ".join(e.message for e in kube.events(name) if e.reason == "PodReplaced")
    assert f"pod {name}-w1-0 replaced: named by a peer" in replaced, replaced
    _assert_world2_untouched(kube_node, operator, kube, name)


def test_suspend_deletes_every_pod_and_resume_brings_the_worlds_back(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, all_gather: str
) -> None:
    """spec.suspend: true (what Kueue sets): every pod goes, the MultiWorld shows Suspended and
    keeps each world's epoch and restarts; false: the pods come back, each world at its next
    epoch, and the leader steps in both again."""
    name = all_gather
    patch = lambda suspend: kubectl(  # noqa: E731
        kube_node,
        "patch",
        "mw",
        name,
        "-n",
        operator.apps,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"suspend": suspend}}),
    )
    patch(True)
    # A reconcile step deletes the pods before it writes its status: wait for both.
    wait_for(f"the pods of {name} gone", lambda: not kube.pods(name), WAIT_S)
    wait_for(f"{name} Suspended", lambda: kube.status(name).get("phase") == "Suspended", WAIT_S)
    status = kube.status(name)
    assert {w: (s["phase"], s["epoch"], s["restarts"]) for w, s in status["worlds"].items()} == {
        "world1": ("Suspended", 1, 0),
        "world2": ("Suspended", 1, 0),
    }
    assert {c["type"]: c["status"] for c in status["conditions"]}["Suspended"] == "True"
    row = kubectl(kube_node, "get", "mw", name, "-n", operator.apps, "--no-headers").split()
    assert row[1] == "Suspended", row
    patch(False)
    wait_running(kube, name, {"world1": 2, "world2": 2})
    for world in ("world1", "world2"):
        _wait_log(kube_node, operator, f"{name}-leader-0", f"rank: 0 from {world} has gathered tensors: ")
    status = kube.status(name)
    assert [status["worlds"][w]["restarts"] for w in ("world1", "world2")] == [0, 0]
    reasons = {e.reason for e in kube.events(name)}
    assert {"WorldSuspended", "WorldResumed"} <= reasons, reasons


def test_a_template_edit_rolls_out_pod_by_pod(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, all_gather: str
) -> None:
    """w2's template gets an environment variable: its two pods are replaced one at a time by
    pods of the new template (world2 moves twice, no restart counted), the status and `kubectl get
    mw` show the pods updated, and the leader and world1 never move."""
    name = all_gather
    before = kube.uids(name)
    manifest = json.loads(kubectl(kube_node, "get", "mw", name, "-n", operator.apps, "-o", "json"))
    template = json.loads(json.dumps(manifest["spec"]["template"]))
    (container,) = template["spec"]["containers"]
    container["env"] = [*container.get("env", []), {"name": "ROLLOUT", "value": "1"}]
    members = [{**m, "template": template} if m["name"] == "w2" else m for m in manifest["spec"]["members"]]
    kubectl(kube_node, "patch", "mw", name, "-n", operator.apps, "--type=merge",
            "-p", json.dumps({"spec": {"members": members}}))  # fmt: skip

    status = _wait_rollout_complete(kube, name, "w2's new template")
    assert status["updated"] == "5/5" and "rollout" not in status, status
    assert {w: (s["epoch"], s["restarts"]) for w, s in status["worlds"].items()} == {
        "world1": (1, 0),
        "world2": (3, 0),
    }
    pods = kube.pods(name)
    for member in EXCLUSIVE["world2"]:
        env = {e.name: e.value for e in pods[f"{name}-{member}"].spec.containers[0].env or []}
        assert env.get("ROLLOUT") == "1", f"{member} is not of w2's new template"
    for member in ("leader-0", *EXCLUSIVE["world1"]):
        assert pods[f"{name}-{member}"].metadata.uid == before[f"{name}-{member}"], f"{member} was replaced"
    updated = [e.message for e in kube.events(name) if e.reason == "PodUpdated"]
    assert len(updated) == 2, updated
    row = kubectl(kube_node, "get", "mw", name, "-n", operator.apps, "--no-headers").split()
    assert row[1:5] == ["Running", "2/2", "0", "5/5"], row
    _wait_log(kube_node, operator, f"{name}-leader-0", "world2 rejoined at epoch 3")


def test_operator_deleted_mid_recovery_converges(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, all_gather: str
) -> None:
    name = all_gather
    (old_operator,) = operator_pods(kube_node, operator)
    signal_container(kube_node, kube.pods(name)[f"{name}-w1-1"], "SIGKILL")
    kubectl(kube_node, "delete", "pod", old_operator.metadata.name, "-n", operator.namespace, "--wait=false")
    new_operator = wait_for(
        "a new operator pod Ready",
        lambda: (p := ready_operator_pod(kube_node, operator)) and p.metadata.uid != old_operator.metadata.uid and p,
        WAIT_S,
    )
    assert new_operator is not None
    status = wait_running(kube, name, {"world1": 2, "world2": 1})
    assert status["worlds"]["world1"]["restarts"] == 1
    with kube_node.api_client() as api:
        every = client.CoreV1Api(api).list_namespaced_pod(operator.apps).items
    members = sorted(_member(name, p.metadata.name) for p in every if p.metadata.deletion_timestamp is None)
    assert members == ["leader-0", "w1-0", "w1-1", "w2-0", "w2-1"], members


@pytest.mark.timeout(BENCH_RUN_S + 60)
def test_node_bench_reports_recovery_and_its_breakdown(kube_node: Cluster) -> None:
    """bench/node_recovery.py --quick on this node: every figure of its documented JSON shape, and the
    pods each kill cost: 1 under `replace: Pod` (a new pod, or the one warm spare), 2 under
    `replace: World` on all_gather's world1 (its two w1 pods), N-1 for world1 of N. Its times
    are the bench's business: no speed is asserted here."""
    result = subprocess.run([sys.executable, "-m", "bench.node_recovery", "--quick", "--json",
                             "--cluster", str(kube_node.directory)],
                            cwd=REPO, capture_output=True, text=True, timeout=BENCH_RUN_S, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    kills = 1  # --quick

    def assert_spread(spread: dict[str, float]) -> None:
        assert set(spread) == {"min", "median", "max"}, figures
        assert 0 < spread["min"] <= spread["median"] <= spread["max"], figures

    top = ("node_recovery_s", "spare_recovery_s", "world_restart_s", "whole_restart_s")
    assert set(figures) == {*top, "replaced_per_kill", "sizes", "breakdown_s", "unaffected"}, figures
    for key in top:
        assert_spread(figures[key])
    replaced = figures["replaced_per_kill"]
    assert set(replaced) == set(top), figures
    assert all(len(counts) == kills for counts in replaced.values()), figures
    assert replaced["node_recovery_s"] == [1] * kills, figures
    assert replaced["spare_recovery_s"] == [1] * kills, figures
    assert replaced["world_restart_s"] == [2] * kills, figures
    assert set(figures["sizes"]) == {"2", "3"}, figures
    for size, scenarios in figures["sizes"].items():
        assert set(scenarios) == {"new_pods", "one_spare", "replace_world"}, figures
        for scenario in scenarios.values():
            assert set(scenario) == {"recovery_s", "replaced_per_kill"}, figures
            assert_spread(scenario["recovery_s"])
        assert scenarios["new_pods"]["replaced_per_kill"] == [1] * kills, figures
        assert scenarios["one_spare"]["replaced_per_kill"] == [1] * kills, figures
        assert scenarios["replace_world"]["replaced_per_kill"] == [int(size) - 1] * kills, figures
    # The example as committed (world1 of 3) is the top-level figures' runs.
    example = figures["sizes"]["3"]
    for key, name in (("new_pods", "node_recovery_s"), ("one_spare", "spare_recovery_s"),
                      ("replace_world", "world_restart_s")):  # fmt: skip
        assert example[key] == {"recovery_s": figures[name], "replaced_per_kill": replaced[name]}, figures
    assert set(figures["breakdown_s"]) == {"operator", "schedule", "container_start", "ready"}
    assert all(v >= 0 for v in figures["breakdown_s"].values()), figures
    assert figures["unaffected"]["restarts"] == 0 and figures["unaffected"]["worst_gap_ratio"] > 0, figures


def test_operator_liveness_probe_passes(kube_node: Cluster, operator: Operator) -> None:
    """Last: the operator pod has run long enough for a failing probe to have restarted it."""
    pod = wait_for("the operator pod", lambda: ready_operator_pod(kube_node, operator), WAIT_S)
    (status,) = pod.status.container_statuses
    started = status.state.running.started_at.timestamp()
    time.sleep(max(0.0, started + LIVENESS_PROVEN_S - time.time()))
    pod = ready_operator_pod(kube_node, operator)
    assert pod is not None
    (status,) = pod.status.container_statuses
    assert status.restart_count == 0 and status.ready
    with kube_node.api_client() as api:
        events = (
            client.CoreV1Api(api)
            .list_namespaced_event(operator.namespace, field_selector=f"involvedObject.name={pod.metadata.name}")
            .items
        )
    # Readiness fails by design until the webhook listens (helm install --wait waits on it); a
    # failed liveness probe is what would restart the operator.
    assert not [e.message for e in events if e.reason == "Unhealthy" and (e.message or "").startswith("Liveness")]


def test_a_manifest_without_the_worker_serviceaccount_runs(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, tmp_path: Path
) -> None:
    """The pods run as the namespace's default ServiceAccount, which may do nothing: a worker
    needs no Kubernetes permission (its pod-bound token, mounted by the operator, is all it shows
    the operator), so every world runs and follows its table."""
    import yaml

    name = "no-worker-account"
    path = example_manifest("all_gather", name, tmp_path)
    manifest = yaml.safe_load(path.read_text())
    del manifest["spec"]["template"]["spec"]["serviceAccountName"]
    path.write_text(yaml.safe_dump(manifest))
    with applied(kube_node, operator, kube, path, name):
        wait_running(kube, name, {"world1": 1, "world2": 1})
        assert {p.spec.service_account_name for p in kube.pods(name).values()} == {"default"}


def test_a_hostile_worker_pod_breaks_nothing(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, tmp_path: Path
) -> None:
    """A pod of our worker image, under the workers' ServiceAccount, attacks for real
    (tests/kube/hostile_worker.py): over the worker channel it reports broken a world it holds
    no rank in and its own world at an epoch to come; through the API server, with the token it
    holds, it patches another member pod's image, creates a decoy world table and deletes the
    NetworkPolicy. Both reports are refused, each said by a Warning Event naming the pod; no
    world moves; every API request is refused and the image stays. The NetworkPolicy, deleted
    by the admin, comes back."""
    name = "hostile"
    manifest = {
        "apiVersion": "multiworld.io/v1alpha1",
        "kind": "MultiWorld",
        "metadata": {"name": name},
        "spec": {
            "template": {"spec": {"serviceAccountName": WORKER_SA, "containers": [{
                "name": "worker", "image": WORKER_IMAGE, "imagePullPolicy": "Never",
                "command": ["python", "-c", (REPO / "tests" / "kube" / "hostile_worker.py").read_text()],
            }]}},
            "members": [{"name": "leader"}, {"name": "other"}, {"name": "attacker"}],
            "worlds": [{"name": "victim", "ranks": ["leader", "other"]},
                       {"name": "own", "ranks": ["leader", "attacker"]}],
        },
    }  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(manifest))
    attacker = f"{name}-attacker-0"
    with applied(kube_node, operator, kube, path, name):
        wait_running(kube, name, {"victim": 1, "own": 1})
        log = _wait_log(kube_node, operator, attacker, "attack network policy:")
        for attack in ("patch", "decoy table", "network policy"):
            assert re.search(rf"attack {attack}: refused 40[13]", log), log

        def both_refused() -> list[str] | None:
            found = [e.message for e in kube.events(name) if e.reason == "ReportRefused" and e.type == "Warning"]
            return found if len(found) == 2 else None

        refused = wait_for("a ReportRefused Event for each forged report", both_refused, WAIT_S)
        assert all(f"pod {attacker} reported world" in message for message in refused), refused
        assert any("world victim broken at a world it holds no rank in" in m for m in refused), refused
        assert any("world own broken at epoch 6, which that world has not reached" in m for m in refused), refused
        worlds = kube.status(name)["worlds"]
        assert {w: (s["epoch"], s["restarts"], s["phase"]) for w, s in worlds.items()} == {
            "victim": (1, 0, "Running"),
            "own": (1, 0, "Running"),
        }
        (container,) = kube.pods(name)[f"{name}-leader-0"].spec.containers
        assert container.image == WORKER_IMAGE
        # What the worker could not do, someone who may: the operator restores the NetworkPolicy.
        kubectl(kube_node, "delete", "networkpolicy", name, "-n", operator.apps)
        wait_for(f"the NetworkPolicy {name} restored", lambda: kube.network_policy(name), WAIT_S)


def test_a_pod_that_cannot_be_scheduled_makes_its_world_wait_not_fail(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, tmp_path: Path
) -> None:
    """world1's workers ask for more GPUs than any node has: world1 stays Pending (naming its
    waiting pods, their member, the GPUs each asks for and the scheduler's words; one Event),
    with no restart however many join timeouts pass, while world2 runs."""
    import yaml

    name = "unschedulable"
    path = example_manifest("all_gather", name, tmp_path)
    manifest = yaml.safe_load(path.read_text())
    template = manifest["spec"]["template"]
    (container,) = template["spec"]["containers"]
    container["env"] = [{"name": "MULTIWORLD_JOIN_TIMEOUT", "value": "3"}]
    gpu = yaml.safe_load(yaml.safe_dump(template))
    gpu["spec"]["containers"][0]["resources"] = {"limits": {GPU_RESOURCE: GPUS_PER_NODE + 1}}
    (w1,) = [m for m in manifest["spec"]["members"] if m["name"] == "w1"]
    w1["template"] = gpu
    path.write_text(yaml.safe_dump(manifest))
    with applied(kube_node, operator, kube, path, name):
        kube.wait_world("world2", lambda s: s["phase"] == "Running", "Running", name=name)
        waiting = kube.wait_world("world1", lambda s: len(s.get("waiting") or {}) == 2, "waiting for w1", name=name)
        world1 = waiting["worlds"]["world1"]
        assert world1["phase"] == "Pending"
        # The scheduler's words, with the member and what each of its pods asks for.
        asked = f"Unschedulable (member w1, {GPUS_PER_NODE + 1} {GPU_RESOURCE} a pod): "
        assert all(r.startswith(asked) and f"Insufficient {GPU_RESOURCE}" in r for r in world1["waiting"].values())
        time.sleep(12)  # several join timeouts of the leader in world1
        world1 = kube.status(name)["worlds"]["world1"]
        assert world1["phase"] == "Pending" and world1["restarts"] == 0 and world1["epoch"] == 1, world1
        (told,) = [e.message for e in kube.events(name) if e.reason == "WorldWaiting"]
        # Said once, naming what waited then (one pod or both).
        assert any(f"pod {pod}: {asked}" in told for pod in world1["waiting"]), told
        assert kube.status(name)["worlds"]["world2"]["phase"] == "Running"


def test_a_rank_0_with_no_record_yet_is_asked_of_the_clusters_dns_alone(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, dns_log: DnsLog, tmp_path: Path
) -> None:
    """The leader (rank 0 of both worlds) asks for more GPUs than any node has, so its name has
    no record, as a new pod's has none until it has an address: the other members ask for it by
    its full name, which the cluster's DNS answers itself. None of their queries is forwarded to
    the machine's nameserver (before, every search of theirs ended there with the bare
    `<pod>.<mw>`, and a lost answer cost the resolver's 5 s timeout after the record existed)."""
    name = "unplaced-leader"
    path = example_manifest("all_gather", name, tmp_path)
    manifest = yaml.safe_load(path.read_text())
    (leader,) = [m for m in manifest["spec"]["members"] if m["name"] == "leader"]
    leader["template"] = yaml.safe_load(yaml.safe_dump(manifest["spec"]["template"]))
    leader["template"]["spec"]["containers"][0]["resources"] = {"limits": {GPU_RESOURCE: GPUS_PER_NODE + 1}}
    path.write_text(yaml.safe_dump(manifest))
    rank0 = f"{name}-leader-0.{name}"
    full_name = f"{rank0}.{operator.apps}.svc.cluster.local"

    def queries() -> list[str] | None:
        """The log's lines about rank 0's name, once the members asked for its full name 20
        times (each of the four asks again and again while it waits for rank 0's store)."""
        lines = dns_log.lines(rank0)
        return lines if sum(f"query[A] {full_name} " in line for line in lines) >= 20 else None

    with applied(kube_node, operator, kube, path, name):
        asked = wait_for("the members' queries for rank 0's full name", queries, WAIT_S)
        assert kube.pods(name)[f"{name}-leader-0"].status.phase == "Pending"
    forwarded = [line for line in asked if "forwarded" in line]
    assert not forwarded, forwarded[:4]


def _spares_ready(kube: KubeNamespace, name: str, member: str, count: int) -> dict[str, client.V1Pod]:
    """Wait until `member` keeps `count` warm spares, each waiting for an identity; returns them."""
    wait_for(
        f"{count} warm spares of {member} ready",
        lambda: (kube.status(name).get("spares") or {}).get(member) == f"{count}/{count}",
        WAIT_S,
    )
    spares = {
        p: pod
        for p, pod in kube.pods(name).items()
        if (pod.metadata.labels or {}).get("multiworld.io/spare") == "true"
        and "multiworld.io/plays" not in pod.metadata.labels
    }
    # Ready: each spare's worker told the operator (over its channel) that it waits for an identity.
    assert len(spares) == count, sorted(spares)
    return spares


def test_warm_spares_take_a_killed_members_place(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, tmp_path: Path, stage: Callable[[str], None]
) -> None:
    """w1 keeps one warm spare: one death takes one spare. A killed w1-1's world comes back with
    the spare playing w1-1 under its own name, labelled and shown in the status, and w1-0 in its
    own pod; the pool refills; world2 and the leader never notice. Then w1's template changes,
    its rollout paused: the spare of the old template goes, and a kill before the new one is warm
    takes the old path (a pod of the member's own name, of the new template). Resumed, the
    rollout puts the last pod of the old template onto the warm spare of the new one."""
    name = "spares"
    path = example_manifest("all_gather", name, tmp_path, spares={"w1": 1})
    with applied(kube_node, operator, kube, path, name):
        wait_running(kube, name, {"world1": 1, "world2": 1})
        spares = _spares_ready(kube, name, "w1", 1)
        assert sorted(spares) == [f"{name}-w1-spare-a"]
        shown = kubectl(kube_node, "get", "pods", "-n", operator.apps, "-l", "multiworld.io/spare", "--no-headers")
        assert sorted(line.split()[0] for line in shown.splitlines()) == sorted(spares), shown
        _wait_log(kube_node, operator, f"{name}-leader-0", "rank: 0 from world1 has gathered tensors: ")
        before = kube.uids(name)
        stage("running_with_a_spare")

        signal_container(kube_node, kube.pods(name)[f"{name}-w1-1"], "SIGKILL")
        status = wait_running(kube, name, {"world1": 2, "world2": 1})
        played = status["playedBy"]
        assert played == {f"{name}-w1-1": f"{name}-w1-spare-a"}, played
        pods = kube.pods(name)
        for member_pod, spare in played.items():
            labels = pods[spare].metadata.labels
            assert labels["multiworld.io/plays"] == member_pod and labels["multiworld.io/member"] == "w1", labels
            assert pods[spare].metadata.uid == before[spare], "a spare plays in the pod it was started in"
            assert member_pod not in pods, f"{member_pod} was created although a spare plays it"
        for member in ("leader-0", "w1-0", *EXCLUSIVE["world2"]):
            assert pods[f"{name}-{member}"].metadata.uid == before[f"{name}-{member}"], f"{member} was replaced"
        table = kube.table(name)["world1"]
        assert table["pods"][1:] == [f"{name}-w1-0", played[f"{name}-w1-1"]], table
        _wait_log(kube_node, operator, f"{name}-leader-0", "world1 rejoined at epoch 2")
        _wait_log(kube_node, operator, f"{name}-w1-0", "world1 rejoined at epoch 2")
        _wait_log(kube_node, operator, played[f"{name}-w1-1"], "rank: 2 has tensor")
        events = " ".join(e.message for e in kube.events(name) if e.reason == "SpareAssigned")
        assert f"plays {name}-w1-1" in events and f"plays {name}-w1-0" not in events, events

        stage("spare_played")
        refilled = _spares_ready(kube, name, "w1", 1)
        assert sorted(refilled) == [f"{name}-w1-spare-b"], sorted(refilled)
        _assert_world2_untouched(kube_node, operator, kube, name)
        stage("refilled")

        # A new template for w1, its rollout paused (a journey of its own): its spares of the old
        # one are deleted, and not one plays.
        manifest = json.loads(kubectl(kube_node, "get", "mw", name, "-n", operator.apps, "-o", "json"))
        template = manifest["spec"]["template"]
        (container,) = template["spec"]["containers"]
        container["env"] = [*container.get("env", []), {"name": "TEMPLATE_EDIT", "value": "1"}]
        (w1,) = [m for m in manifest["spec"]["members"] if m["name"] == "w1"]
        members = [{**m, "template": template} if m is w1 else m for m in manifest["spec"]["members"]]
        patch = {"spec": {"members": members, "updateStrategy": {"paused": True}}}
        kubectl(kube_node, "patch", "mw", name, "-n", operator.apps, "--type=merge", "-p", json.dumps(patch))
        wait_for("w1's spares of the old template gone", lambda: not set(refilled) & set(kube.pods(name)), WAIT_S)
        signal_container(kube_node, kube.pods(name)[played[f"{name}-w1-1"]], "SIGKILL")
        status = wait_running(kube, name, {"world1": 3, "world2": 1})
        assert not status.get("playedBy"), status.get("playedBy")
        pods = kube.pods(name)
        env = {e.name: e.value for e in pods[f"{name}-w1-1"].spec.containers[0].env or []}
        assert env.get("TEMPLATE_EDIT") == "1", "w1-1 is not of w1's new template"
        assert pods[f"{name}-w1-0"].metadata.uid == before[f"{name}-w1-0"], "the live w1-0 was replaced"
        assert not set(played.values()) & set(pods), "the spare that played was not deleted"
        stage("old_template_path")
        (warm,) = _spares_ready(kube, name, "w1", 1)
        _assert_world2_untouched(kube_node, operator, kube, name)
        stage("new_template_spare")

        # The rollout resumed: w1-0, the one pod left of the old template, goes onto the warm
        # spare of the new one (no pod made for it, no restart counted).
        before = kube.uids(name)
        kubectl(kube_node, "patch", "mw", name, "-n", operator.apps, "--type=merge",
                "-p", json.dumps({"spec": {"updateStrategy": {"paused": False}}}))  # fmt: skip
        status = _wait_rollout_complete(kube, name, "w1's new template onto its warm spare")
        assert status["playedBy"] == {f"{name}-w1-0": warm}, status.get("playedBy")
        assert (status["worlds"]["world1"]["epoch"], status["worlds"]["world1"]["restarts"]) == (4, 2), status
        pods = kube.pods(name)
        assert pods[warm].metadata.uid == before[warm], "the spare plays in the pod it was started in"
        assert f"{name}-w1-0" not in pods, "w1-0 was made again although a spare plays it"
        updated = [e.message for e in kube.events(name) if e.reason == "PodUpdated"]
        assert len(updated) == 1 and f"pod {name}-w1-0 " in updated[0], updated
        _wait_log(kube_node, operator, warm, "rank: 1 has tensor")
        _assert_world2_untouched(kube_node, operator, kube, name)
        stage("rollout_onto_the_spare")
    stage("deleted")


# Issue 33's chain: two levels of sharing (b in wx and wy, c in wy and wz), every member in use
# (worlds not named y: YAML 1.1 reads a bare y as true).
CHAIN_WORLDS = {"wx": ["a", "b"], "wy": ["b", "c"], "wz": ["c", "d"]}


def test_a_chain_of_shared_members_recovers_from_each_kill_and_rolls_out(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, tmp_path: Path
) -> None:
    """Each pod of the chain deleted in turn (as `kubectl delete pod` does: with a grace period,
    so the old process outlives its Pod object for a moment while its name already leads to the
    replacement): only the worlds it holds a rank in move, and they run again at once with
    every rank; then a template edit rolls every pod out with no restart counted. (On this node
    it passed before issue 33's fixes too: their regression tests are the worker's and the
    examples' own.)"""
    name = "chain"
    path = example_manifest("all_gather", name, tmp_path, interval=0.2)
    manifest = yaml.safe_load(path.read_text())
    manifest["spec"]["members"] = [{"name": "a"}, {"name": "b"}, {"name": "c"}, {"name": "d", "replicas": 2}]
    policy = manifest["spec"]["worlds"][0]["failurePolicy"]
    manifest["spec"]["worlds"] = [{"name": w, "ranks": r, "failurePolicy": policy} for w, r in CHAIN_WORLDS.items()]
    path.write_text(yaml.safe_dump(manifest))
    with applied(kube_node, operator, kube, path, name):
        epochs = dict.fromkeys(CHAIN_WORLDS, 1)
        wait_running(kube, name, epochs)
        for pod in ("a-0", "b-0", "c-0", "d-1"):
            member = pod.split("-")[0]
            kubectl(kube_node, "delete", "pod", f"{name}-{pod}", "-n", operator.apps, "--wait=false")
            for world, ranks in CHAIN_WORLDS.items():
                epochs[world] += member in ranks
            wait_running(kube, name, epochs)
        restarts = {w: s["restarts"] for w, s in kube.status(name)["worlds"].items()}

        template = json.loads(json.dumps(manifest["spec"]["template"]))
        (container,) = template["spec"]["containers"]
        container["env"] = [*container.get("env", []), {"name": "ROLLOUT", "value": "1"}]
        started = time.monotonic()
        kubectl(kube_node, "patch", "mw", name, "-n", operator.apps, "--type=merge",
                "-p", json.dumps({"spec": {"template": template}}))  # fmt: skip
        status = _wait_rollout_complete(kube, name, "the chain's new template")
        print(f"chain rollout of 5 pods: {time.monotonic() - started:.1f} s")
        failed = [e.message for e in kube.events(name) if e.reason == "WorldFailed"]
        assert {w: s["restarts"] for w, s in status["worlds"].items()} == restarts, failed
        for instance in kube.pods(name).values():
            env = {e.name: e.value for e in instance.spec.containers[0].env or []}
            assert env.get("ROLLOUT") == "1", f"{instance.metadata.name} is not of the new template"
        for world, ranks in CHAIN_WORLDS.items():
            _wait_log(kube_node, operator, f"{name}-{ranks[-1]}-0", f"from {world} has gathered tensors: ")
