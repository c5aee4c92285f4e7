"""What the node-loss journeys and bench/node_loss.py share: where a MultiWorld's pods are asked
to go, a warm spare added where the operator places it, the GPUs each pod was given, and the
watch from a fault until every world with a rank on the lost node runs again."""

from __future__ import annotations

import copy
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from tests.cluster.cluster import Cluster
from tests.cluster.host import cgroup_pids
from tests.support.node_support import WAIT_S, Operator, kubectl
from tests.support.operator_support import KubeNamespace, wait_for


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


def pod_processes(node_cgroup: str, uids: set[str]) -> list[int]:
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


def formed_at(world: dict[str, Any]) -> float | None:
    at = world.get("formedAt")
    return datetime.fromisoformat(str(at).replace("Z", "+00:00")).timestamp() if at else None


def watch_recovery(
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
            if pod.status.pod_ip:
                timeline.note(f"ip {pod.metadata.uid}", f"pod {pod.metadata.name} has IP {pod.status.pod_ip}")
        # What the pods' names resolve to follows the headless Service's Endpoints (cluster DNS).
        for subset in kube.core.read_namespaced_endpoints(name, kube.namespace).subsets or []:
            for address in [*(subset.addresses or []), *(subset.not_ready_addresses or [])]:
                timeline.note(f"endpoint {address.ip}", f"endpoint {address.hostname} at {address.ip}")
        for world, state in (status.get("worlds") or {}).items():
            failure = state.get("lastFailure") or {}
            if failure:
                timeline.note(
                    f"failure {world} {failure.get('epoch')}",
                    f"{world} failed at epoch {failure.get('epoch')}: {failure.get('reason')} "
                    f"{failure.get('pod', '')} {failure.get('message', '')}",
                )
            timeline.note(f"{world} {state['phase']} {state['epoch']}", f"{world} {state['phase']} at {state['epoch']}")
            formed = formed_at(state)
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


def placed_by_preference(path: Path, on_lost: set[str], lost: str, kept: str, unplaced: Collection[str] = ()) -> None:
    """Each member of the manifest at `path` prefers node `lost` (those in `on_lost`) or `kept`,
    less than the operator prefers another node than one where a pod went silent; those in
    `unplaced` are left to the scheduler."""
    manifest = yaml.safe_load(path.read_text())
    spec = manifest["spec"]
    for member in spec["members"]:
        template = member["template"] = copy.deepcopy(spec["template"])
        if member["name"] in unplaced:
            continue
        node = lost if member["name"] in on_lost else kept
        term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        template["spec"]["affinity"] = {
            "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 50, "preference": term}]}
        }
    path.write_text(yaml.safe_dump(manifest))


def add_spare(cluster: Cluster, operator: Operator, kube: KubeNamespace, path: Path, name: str, member: str) -> None:
    """One warm spare of `member` added to the running MultiWorld (`spares: 1`, kubectl apply),
    placed as the operator asks by default (off the nodes of the pods it stands in for); waits
    until it is ready."""
    manifest = yaml.safe_load(path.read_text())
    for entry in manifest["spec"]["members"]:
        if entry["name"] == member:
            entry["spares"] = 1
    path.write_text(yaml.safe_dump(manifest))
    kubectl(cluster, "apply", "-n", operator.apps, "-f", str(path))
    wait_for(
        f"{member}'s warm spare ready", lambda: (kube.status(name).get("spares") or {}).get(member) == "1/1", WAIT_S
    )


def gpus_given(cluster: Cluster, pods: dict[str, client.V1Pod]) -> dict[str, str]:
    """Per pod, the devices its node's device plugin gave it: NVIDIA_VISIBLE_DEVICES in its
    processes' environment, read on its node (the pause process has none)."""
    given = {}
    for name, pod in pods.items():
        for pid in pod_processes(cluster.node_named(pod.spec.node_name).cgroup_root, {pod.metadata.uid}):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            devices = [e.partition(b"=")[2].decode() for e in env if e.startswith(b"NVIDIA_VISIBLE_DEVICES=")]
            if devices:
                given[name] = devices[0]
    return given
