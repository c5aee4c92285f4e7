"""Node loss on real nodes (issue 34): a MultiWorld of examples/all_gather on the session's two
nodes, the operator on the first; the second node is powered off or cut off the network
(tests/cluster's faults), and the journey reads what a user would: the MultiWorld's status and
Events, its pods and where they run. Where its pods go is asked of the scheduler (a preferred
node affinity, so that replacements may go elsewhere): only the shared leader on the lost node
(its live peers name it), or every pod (no live peer: the operator's channel finds the loss).
It prints the timeline, fault to every rank joined at the new epoch (`formedAt`, the workers'
clock: the same machine's)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.cluster import Cluster
from tests.support.node_loss import Timeline, formed_at, placed_by_preference, pod_processes, watch_recovery
from tests.support.node_support import (
    WAIT_S,
    Operator,
    applied,
    example_manifest,
    installed_operator,
)
from tests.support.operator_support import KubeNamespace, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.node, pytest.mark.node_fault]

# What a world may take, fault to every rank joined at its new epoch, on 2 cores shared with other
# work. Kubernetes' own path (NotReady after 40 s, eviction 300 s later) takes minutes.
BACK_WITHIN_S = 60.0
# How soon a healed node's kubelet ends the processes of the pods deleted while it was away.
OLD_GONE_WITHIN_S = 60.0
# bench/node_loss.py --quick: two trials, each a MultiWorld applied, a fault, a heal and a delete.
BENCH_RUN_S = 900.0
REPO = Path(__file__).resolve().parents[2]
# How long the worlds are watched after that, for an old process breaking in.
QUIET_AFTER_S = 10.0


@pytest.fixture(scope="module")
def operator(kube_node: Cluster) -> Iterator[Operator]:
    """The chart's operator, on the first node: the journeys lose another."""
    if len(kube_node.nodes) < 2:
        pytest.fail(f"the session cluster runs {len(kube_node.nodes)} node; node loss needs two", pytrace=False)
    with installed_operator(kube_node, node=kube_node.nodes[0].name) as installed:

        def ready() -> bool:
            with kube_node.api_client() as api:
                pods = client.CoreV1Api(api).list_namespaced_pod(installed.namespace).items
            return any(
                p.status.phase == "Running" and all(s.ready for s in p.status.container_statuses or []) for p in pods
            )

        wait_for("the operator's pod Running and Ready", ready, WAIT_S)
        yield installed


@pytest.fixture
def kube(kube_node: Cluster, operator: Operator) -> Iterator[KubeNamespace]:
    with kube_node.api_client() as api:
        yield KubeNamespace(api, operator.apps)


@pytest.mark.parametrize(("fault", "on_lost"), [("power-off", {"leader"}), ("partition", {"leader", "w1", "w2"})])
def test_a_lost_node_costs_its_worlds_seconds(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, tmp_path: Path, fault: str, on_lost: set[str]
) -> None:
    name = f"lost-{fault}"
    lost, kept = kube_node.nodes[1].name, kube_node.nodes[0].name
    path = example_manifest("all_gather", name, tmp_path)
    placed_by_preference(path, on_lost, lost, kept)
    with applied(kube_node, operator, kube, path, name):

        def running() -> dict[str, Any] | None:
            status = kube.status(name)
            worlds = status.get("worlds") or {}
            up = status.get("phase") == "Running" and all(formed_at(w) for w in worlds.values())
            return status if up and worlds else None

        status = wait_for(f"{name} Running", running, WAIT_S)
        pods = kube.pods(name)
        placed = {p: pod.spec.node_name for p, pod in pods.items()}
        table = kube.table(name)
        hit = {w for w in status["worlds"] if any(placed.get(p) == lost for p in table[w]["pods"])}
        old = {pod.metadata.uid for pod in pods.values() if pod.spec.node_name == lost}
        node_cgroup = kube_node.node_named(lost).cgroup_root
        epochs = {w: s["epoch"] for w, s in status["worlds"].items()}
        print(f"\n{fault} of {lost}; pods: {placed}; worlds with a rank there: {sorted(hit)}")
        wanted = {p: lost if any(p.startswith(f"{name}-{m}-") for m in on_lost) else kept for p in placed}
        assert placed == wanted, f"the scheduler placed {name}'s pods otherwise than asked: {placed}"
        timeline = Timeline(time.time())
        try:
            if fault == "power-off":
                kube_node.power_off(lost)
            else:
                kube_node.partition(lost)
            back = watch_recovery(kube, name, lost, hit, epochs, timeline, 420.0)
        finally:
            print(timeline)
            healing = time.monotonic()
            kube_node.heal(lost)
            healed = time.monotonic()
        print(f"{fault}: fault to every rank joined at the new epoch: {back}")
        status = kube.status(name)
        for world in set(epochs) - hit:
            assert status["worlds"][world]["epoch"] == epochs[world], f"{world} moved without a rank on {lost}"
        assert max(back.values()) < BACK_WITHIN_S, back
        assert not {p.metadata.uid for p in kube.pods(name).values()} & old, "a lost instance is still in the API"
        # The healed node's old processes (a partition's still ran) end: their pods are gone.
        wait_for(
            f"the processes of the pods lost with {lost} gone once it is back",
            lambda: not pod_processes(node_cgroup, old),
            OLD_GONE_WITHIN_S,
        )
        gone = time.monotonic()
        print(f"{fault}: heal took {healed - healing:.1f} s; the lost pods' processes gone {gone - healed:.1f} s after")
        # Nor did they break into a world meanwhile or since: every epoch is as it came back.
        now = {w: s["epoch"] for w, s in kube.status(name)["worlds"].items()}
        time.sleep(QUIET_AFTER_S)
        later = kube.status(name)
        assert {w: s["epoch"] for w, s in later["worlds"].items()} == now, later
        assert all(s["phase"] == "Running" for s in later["worlds"].values()), later


def test_node_loss_bench_reports_each_fault_and_mode(kube_node: Cluster) -> None:
    """bench/node_loss.py --quick on the session's nodes: its documented JSON shape, a power-off
    whose leader's ranks a warm spare took, a partition's a new pod, and Kubernetes' own path
    beside them (NotReady after its grace period, eviction its toleration later). Its times are
    the bench's business: no speed is asserted here."""
    result = subprocess.run([sys.executable, "-m", "bench.node_loss", "--quick", "--json",
                             "--cluster", str(kube_node.directory)],
                            cwd=REPO, capture_output=True, text=True, timeout=BENCH_RUN_S, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(figures) == {"scenarios", "kubernetes_path_s"}, figures
    scenarios = figures["scenarios"]
    assert set(scenarios) == {"power-off/warm_spare", "partition/new_pod"}, figures
    for scenario in scenarios.values():
        assert set(scenario) == {"recovery_s", "trials", "by_spare"}, figures
        assert len(scenario["trials"]) == 1 and scenario["trials"][0] > 0, figures
        assert scenario["recovery_s"]["median"] == scenario["trials"][0], figures
    assert scenarios["power-off/warm_spare"]["by_spare"] == [True], figures
    assert scenarios["partition/new_pod"]["by_spare"] == [False], figures
    path = figures["kubernetes_path_s"]
    assert path["toleration_s"] == 300, figures  # the API server's default, on every pod
    assert path["not_ready_s"] > scenarios["power-off/warm_spare"]["trials"][0], figures
    assert path["eviction_s"] == path["not_ready_s"] + path["toleration_s"], figures
