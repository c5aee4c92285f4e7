"""A world failure costs API writes for that world only: its pods, its table entry, a few writes
of the operator's memory and of the status, its Events, whether the MultiWorld has two worlds or
six. Counted by the API server itself (its
apiserver_request_total metric), not by the operator."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from kubernetes import client

from tests.support.operator_support import KubeNamespace, Scene, manifest, wait_for

pytestmark = pytest.mark.kube

# Writes the operator makes (the python client speaks JSON; the controller-manager's garbage
# collector and namespace cleanup speak protobuf, and the kubelet stand-in only patches pod status).
COUNTED = {
    ("POST", "pods", ""),
    ("DELETE", "pods", ""),
    ("PATCH", "multiworlds", "status"),
    ("PUT", "configmaps", ""),
    ("POST", "configmaps", ""),
    ("DELETE", "configmaps", ""),
}
SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="([^"]*)"')


def write_counts(api: client.ApiClient) -> Counter[tuple[str, str, str]]:
    request = api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"])
    response = api.call_api(*request)
    data = response.read()
    counts: Counter[tuple[str, str, str]] = Counter()
    for line in data.decode().splitlines():
        sample = SAMPLE.match(line)
        if sample is None:
            continue
        labels = dict(LABEL.findall(sample["labels"]))
        key = (labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))
        if key in COUNTED and labels.get("contentType") == "application/json":
            counts[key] += int(float(sample["value"]))
    return counts


def star(name: str, worlds: int) -> dict:
    """A leader shared by `worlds` worlds, each with two exclusive pods."""
    members = {"leader": 1, **{f"m{i}": 2 for i in range(worlds)}}
    return manifest(name, members, {f"w{i}": ["leader", f"m{i}"] for i in range(worlds)})


def failure_cost(scene: Scene, name: str, worlds: int) -> tuple[Counter[tuple[str, str, str]], Counter[str]]:
    """Writes and Events of one exclusive pod's failure, from the failure to the world whole again."""
    kube: KubeNamespace = scene.kube
    kube.create(star(name, worlds))
    kube.wait_running(name, epochs={f"w{i}": 1 for i in range(worlds)})
    # Events follow the status write that causes them: wait for the start's last ones.
    wait_for("a WorldReady event per world", lambda: kube.event_reasons(name).count("WorldReady") == worlds)
    events = Counter(kube.event_reasons(name))
    before = write_counts(kube.api)

    scene.kubelet.fail(f"{name}-m0-1")
    kube.wait_running(name, epochs={"w0": 2, **{f"w{i}": 1 for i in range(1, worlds)}})
    wait_for("the recovery's Events", lambda: "WorldRecovered" in kube.event_reasons(name))
    return write_counts(kube.api) - before, Counter(kube.event_reasons(name)) - events


def test_writes_per_world_failure_do_not_grow_with_the_worlds(scene: Scene) -> None:
    small, small_events = failure_cost(scene, "small", 2)
    large, large_events = failure_cost(scene, "large", 6)

    for cost in (small, large):
        # Only the failed pod, replaced once (its live peer stays and joins the new epoch).
        assert (cost["DELETE", "pods", ""], cost["POST", "pods", ""]) == (1, 1)
        # The epoch bump, then at most one patch per replacement pod appearing and one running;
        # the operator's memory as often; the world's table entry for the new epoch and for the
        # new instances in it.
        assert 1 <= cost["PATCH", "multiworlds", "status"] <= 1 + 2 * 1
        assert cost["POST", "configmaps", ""] == cost["DELETE", "configmaps", ""] == 0
        assert 2 <= cost["PUT", "configmaps", ""] <= 2 * (1 + 2 * 1)
    assert small_events == large_events == Counter({"WorldFailed": 1, "WorldRecovered": 1})
