"""Node loss on real nodes (issue 34): a MultiWorld of examples/all_gather on the session's two
nodes, the operator on the first; the second node is powered off or cut off the network
(tests/cluster's faults), and the journey reads what a user would: the MultiWorld's status and
Events, its pods and where they run. Where its pods go is asked of the scheduler (a preferred
node affinity, so that replacements may go elsewhere): only the shared leader on the lost node
(its live peers name it), or every pod (no live peer: the operator's channel finds the loss).
It prints the timeline, fault to every rank joined at the new epoch (`formedAt`, the workers'
clock: the same machine's)."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.cluster.cluster import Cluster
from tests.cluster.host import cgroup_pids
from tests.support.node_support import (
    WAIT_S,
    Operator,
    applied,
    example_manifest,
    install_operator,
)
from tests.support.operator_support import KubeNamespace, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.node, pytest.mark.node_fault]

# What a world may take, fault to every rank joined at its new epoch, on 2 cores shared with other
# work. Kubernetes' own path (NotReady after 40 s, eviction 300 s later) takes minutes.
BACK_WITHIN_S = 60.0
# How soon a healed node's kubelet ends the processes of the pods deleted while it was away.
OLD_GONE_WITHIN_S = 60.0
# How long the worlds are watched after that, for an old process breaking in.
QUIET_AFTER_S = 10.0


@pytest.fixture(scope="module")
def operator(kube_node: Cluster) -> Operator:
    """The chart's operator, on the first node: the journeys lose another."""
    if len(kube_node.nodes) < 2:
        pytest.fail(f"the session cluster runs {len(kube_node.nodes)} node; node loss needs two", pytrace=False)
    installed = install_operator(kube_node, node=kube_node.nodes[0].name)

    def ready() -> bool:
        with kube_node.api_client() as api:
            pods = client.CoreV1Api(api).list_namespaced_pod(installed.namespace).items
        return any(
            p.status.phase == "Running" and all(s.ready for s in p.status.container_statuses or []) for p in pods
        )

    wait_for("the operator's pod Running and Ready", ready, WAIT_S)
    return installed


@pytest.fixture
def kube(kube_node: Cluster, operator: Operator) -> Iterator[KubeNamespace]:
    with kube_node.api_client() as api:
        yield KubeNamespace(api, operator.apps)


@dataclass
class Timeline:
    """What the status and the pods showed after the fault, each first sighting with its time."""

    fault: float
    lines: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)

    def note(self, key: str, text: str) -> None:
        if key not in self.seen:
            self.seen.add(key)
            self.lines.append(f"{time.time() - self.fault:7.2f} s  {text}")

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _pod_processes(node_cgroup: str, uids: set[str]) -> list[int]:
    """The processes on a node (its cgroup) of the pod instances `uids` (the kubelet names a pod's
    cgroup by its uid, with dashes or, under systemd, underscores)."""
    marks = {uid.replace("-", sep) for uid in uids for sep in ("-", "_")}
    found = []
    for pid in cgroup_pids(node_cgroup):
        try:
            groups = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            continue
        if any(mark in groups for mark in marks):
            found.append(pid)
    return found


def _formed(world: dict[str, Any]) -> float | None:
    at = world.get("formedAt")
    return datetime.fromisoformat(str(at).replace("Z", "+00:00")).timestamp() if at else None


def _watch_recovery(
    kube: KubeNamespace, name: str, lost: str, hit: set[str], epochs: dict[str, int], timeline: Timeline, limit: float
) -> dict[str, float]:
    """Poll until every world in `hit` runs at a later epoch with every rank joined and none of
    its pods on node `lost`; note what changes on the way. Returns each hit world's seconds from
    the fault to its formedAt at the new epoch."""
    back: dict[str, float] = {}
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        status, table, pods = kube.status(name), kube.table(name), kube.pods(name)
        for pod in pods.values():
            where = pod.spec.node_name or "(unscheduled)"
            timeline.note(f"pod {pod.metadata.uid}", f"pod {pod.metadata.name} {pod.status.phase} on {where}")
        for world, state in (status.get("worlds") or {}).items():
            failure = state.get("lastFailure") or {}
            if failure:
                timeline.note(
                    f"failure {world} {failure.get('epoch')}",
                    f"{world} failed at epoch {failure.get('epoch')}: {failure.get('reason')} "
                    f"{failure.get('pod', '')} {failure.get('message', '')}",
                )
            timeline.note(f"{world} {state['phase']} {state['epoch']}", f"{world} {state['phase']} at {state['epoch']}")
            formed = _formed(state)
            ranks = (table.get(world) or {}).get("pods") or []
            on_lost = [p for p in ranks if p not in pods or pods[p].spec.node_name == lost]
            if (
                world in hit
                and world not in back
                and state["epoch"] > epochs[world]
                and state["phase"] == "Running"
                and formed
                and not on_lost
            ):
                back[world] = formed - timeline.fault
                timeline.note(
                    f"back {world}", f"{world} back at epoch {state['epoch']}: formed at +{back[world]:.2f} s"
                )
        if set(back) == hit:
            return back
        time.sleep(0.2)
    raise AssertionError(f"not every world hit by the loss of {lost} came back within {limit:.0f} s:\n{timeline}")


def _placed(path: Path, on_lost: set[str], lost: str, kept: str) -> None:
    """Each member of the manifest at `path` prefers node `lost` (those in `on_lost`) or `kept`,
    less than the operator prefers another node than one where a pod went silent."""
    manifest = yaml.safe_load(path.read_text())
    spec = manifest["spec"]
    for member in spec["members"]:
        template = member["template"] = copy.deepcopy(spec["template"])
        node = lost if member["name"] in on_lost else kept
        term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        template["spec"]["affinity"] = {
            "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 50, "preference": term}]}
        }
    path.write_text(yaml.safe_dump(manifest))


@pytest.mark.parametrize(("fault", "on_lost"), [("power-off", {"leader"}), ("partition", {"leader", "w1", "w2"})])
def test_a_lost_node_costs_its_worlds_seconds(
    kube_node: Cluster, operator: Operator, kube: KubeNamespace, tmp_path: Path, fault: str, on_lost: set[str]
) -> None:
    name = f"lost-{fault}"
    lost, kept = kube_node.nodes[1].name, kube_node.nodes[0].name
    path = example_manifest("all_gather", name, tmp_path)
    _placed(path, on_lost, lost, kept)
    with applied(kube_node, operator, kube, path, name):

        def running() -> dict[str, Any] | None:
            status = kube.status(name)
            worlds = status.get("worlds") or {}
            up = status.get("phase") == "Running" and all(_formed(w) for w in worlds.values())
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
            back = _watch_recovery(kube, name, lost, hit, epochs, timeline, 420.0)
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
            lambda: not _pod_processes(node_cgroup, old),
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
