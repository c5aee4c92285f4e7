"""A hostile pod on the real nodes' pod network, speaking no protocol of ours (issue 32's
adversary kit, on the node): tests/kube/raw_adversary.py, from raw sockets, scans every TCP port
of the operator's pod and of another tenant's MultiWorld's pods, asks each open port for its keys
as a TCPStore client would, sends each open port junk, and floods every port of the operator's
pod. Meanwhile that MultiWorld loses a pod, as it did once
before the attack (its baseline, in the same test), and the stances' invariants hold:

- no port of that MultiWorld's pods lists a key (its worlds' stores among them);
- its failed world is back within 3 times the baseline, and its other world never moves;
- the operator's container neither restarts nor is replaced, and its process's peak RSS stays
  under the chart's memory limit;
- the operator refused the flood (it closed connections of the attacker's) and said so in its log
  once per kind, naming the attacker's address, not once per connection.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.cluster.cluster import Cluster
from tests.support.node_loss import pod_processes
from tests.support.node_support import (
    REPO,
    WAIT_S,
    WORKER_IMAGE,
    Operator,
    applied,
    example_manifest,
    kubectl,
    ready_operator_pod,
    signal_container,
    wait_running,
)
from tests.support.operator_support import KubeNamespace, wait_for
from tests.support.tenant import CHART_LIMIT_MIB

pytestmark = [pytest.mark.kube, pytest.mark.node]

BYSTANDER = "bystander"
ATTACKER = "raw-adversary"
# Connections the attacker holds on each open port of the operator's pod.
HOLD = 200
# How much slower than its baseline the bystander's recovery may be under the attack.
SLOWDOWN = 3


def _recovery_s(kube_node: Cluster, kube: KubeNamespace, epoch: int) -> float:
    """Seconds from w1-1's container killed until the bystander runs again, world1 at `epoch`."""
    started = time.monotonic()
    signal_container(kube_node, kube.pods(BYSTANDER)[f"{BYSTANDER}-w1-1"], "SIGKILL")
    wait_running(kube, BYSTANDER, {"world1": epoch, "world2": 1})
    return time.monotonic() - started


def _attacker_pod(scan: list[str], flood: list[str]) -> dict[str, object]:
    script = (REPO / "tests" / "kube" / "raw_adversary.py").read_text()
    env = {
        "ADVERSARY_SCAN": ",".join(scan),
        "ADVERSARY_FLOOD": ",".join(flood),
        "ADVERSARY_HOLD": str(HOLD),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": ATTACKER},
        "spec": {
            "automountServiceAccountToken": False,
            "restartPolicy": "Never",
            "containers": [{
                "name": "attacker", "image": WORKER_IMAGE, "imagePullPolicy": "Never",
                "command": ["python", "-c", script],
                "env": [{"name": k, "value": v} for k, v in env.items()],
                # A tenant's CPU is its quota's business: the flood is what is under test.
                "resources": {"limits": {"cpu": "500m", "memory": "512Mi"}},
            }],
        },
    }  # fmt: skip


def _peak_rss_mib(kube_node: Cluster, pod: client.V1Pod) -> float:
    """The highest peak RSS (VmHWM) of the pod's processes, read on its node."""
    peaks = [0.0]
    for pid in pod_processes(kube_node.node_named(pod.spec.node_name).cgroup_root, {pod.metadata.uid}):
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        peaks += [int(line.split()[1]) / 1024 for line in lines if line.startswith("VmHWM:")]
    return max(peaks)


def test_a_raw_socket_scan_and_flood_costs_another_multiworld_nothing(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, tmp_path: Path
) -> None:
    with applied(kube_node, operator, kube, example_manifest("all_gather", BYSTANDER, tmp_path), BYSTANDER):
        wait_running(kube, BYSTANDER, {"world1": 1, "world2": 1})
        baseline = _recovery_s(kube_node, kube, 2)
        before = ready_operator_pod(kube_node, operator)
        assert before is not None
        (restarts,) = [s.restart_count for s in before.status.container_statuses]
        pods = kube.pods(BYSTANDER)
        scan = [before.status.pod_ip, *(pods[f"{BYSTANDER}-{m}"].status.pod_ip for m in ("leader-0", "w2-0"))]
        path = tmp_path / "attacker.yaml"
        path.write_text(yaml.safe_dump(_attacker_pod(scan, [before.status.pod_ip])))
        kubectl(kube_node, "apply", "-n", operator.apps, "-f", str(path))
        try:

            def flooding() -> str | None:
                log = kubectl(kube_node, "logs", "-n", operator.apps, ATTACKER, check=False)
                return log if re.search(r"flood: \d+ opened, [1-9]\d* closed", log) else None

            log = wait_for("the attacker's scan done and its flood refused", flooding, WAIT_S)
            opened = re.findall(rf"scan {re.escape(before.status.pod_ip)} \S+: open \[([\d, ]+)\]", log)
            assert opened, f"the scan found no open port of the operator's pod:\n{log}"
            attacked = _recovery_s(kube_node, kube, 3)
            attacker = kube.core.read_namespaced_pod(ATTACKER, operator.apps)
            assert attacker.status.phase == "Running", "the attacker stopped: " + kubectl(
                kube_node, "logs", "-n", operator.apps, ATTACKER, check=False
            )
            flood_log = kubectl(kube_node, "logs", "-n", operator.apps, ATTACKER, check=False)
            after = ready_operator_pod(kube_node, operator)
            assert after is not None and after.metadata.uid == before.metadata.uid, "the operator's pod was replaced"
            assert [s.restart_count for s in after.status.container_statuses] == [restarts]
            rss = _peak_rss_mib(kube_node, after)
            operator_log = kubectl(kube_node, "logs", "-n", operator.namespace, after.metadata.name)
        finally:
            kubectl(kube_node, "delete", "pod", ATTACKER, "-n", operator.apps, "--wait=false")
        print(f"\nbystander back in {baseline:.2f} s, {attacked:.2f} s under the attack; peak RSS {rss:.0f} MiB")
        print(
            *[line for line in flood_log.splitlines() if line.startswith("scan ")], flood_log.splitlines()[-1], sep="\n"
        )
        # No port of the bystander's pods (their worlds' stores and beat stores among them) listed a key.
        assert not re.findall(r"^listed .*$", flood_log, re.M), flood_log
        assert attacked <= SLOWDOWN * baseline, (baseline, attacked)
        assert 0 < rss < CHART_LIMIT_MIB, rss
        world2 = kube.status(BYSTANDER)["worlds"]["world2"]
        assert (world2["epoch"], world2["restarts"], world2["phase"]) == (1, 0, "Running"), world2
        # Said, and said once per kind: a line per surface and kind, naming the attacker's address.
        source = re.escape(attacker.status.pod_ip)
        said = [line for line in operator_log.splitlines() if re.search(rf"\b{source}\b", line)]
        assert said, operator_log[-3000:]
        kinds = Counter(re.sub(r"\d+", "#", line.split("] ", 1)[-1]) for line in said)
        assert max(kinds.values()) == 1, said
