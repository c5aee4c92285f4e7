"""Spec edits touch only what changed; invalid specs create nothing and say why (status and an
Event naming the field); the CRD schema itself refuses wrong types."""

from __future__ import annotations

import pytest
from kubernetes.client.rest import ApiException

from tests.cluster.cluster import Cluster
from tests.support.operator_support import (
    TWO_WORLDS_PODS,
    KubeNamespace,
    Scene,
    cluster_release,
    manifest,
    two_worlds,
    wait_for,
)

pytestmark = pytest.mark.kube

PODS = TWO_WORLDS_PODS


def test_adding_a_world_leaves_running_pods_alone(scene: Scene) -> None:
    kube = scene.kube
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})
    before = kube.uids()
    ports = {name: w["port"] for name, w in kube.table().items()}

    spec = two_worlds()["spec"]
    spec["members"].append({"name": "c", "replicas": 1})
    spec["worlds"].append({"name": "wc", "ranks": ["leader", "c"]})
    kube.patch_spec("mw", spec)
    status = kube.wait_running(epochs={"wa": 1, "wb": 1, "wc": 1})

    after = kube.uids()
    assert set(after) == PODS | {"mw-c-0"}
    assert {p: after[p] for p in PODS} == before
    table = kube.table()
    assert {n: table[n]["port"] for n in ports} == ports  # ports are stable across edits
    assert len({w["port"] for w in table.values()}) == 3  # and distinct on the shared rank 0
    assert table["wc"]["pods"] == ["mw-leader-0", "mw-c-0"]
    assert status["observedGeneration"] == 2
    assert wait_for("a WorldAdded event", lambda: "WorldAdded" in kube.event_reasons())


def test_removing_a_member_deletes_only_its_pods(scene: Scene) -> None:
    kube = scene.kube
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})
    before = kube.uids()

    # Member b and its world wb go; the shared leader and wa stay as they are.
    spec = manifest("mw", {"leader": 1, "a": 2}, {"wa": ["leader", "a"]})["spec"]
    kube.patch_spec("mw", spec)
    status = kube.wait_running(epochs={"wa": 1})

    remaining = kube.wait_pods({"mw-leader-0", "mw-a-0", "mw-a-1"})
    assert {p: pod.metadata.uid for p, pod in remaining.items()} == {p: before[p] for p in remaining}
    assert list(kube.table()) == ["wa"]
    assert status["worldsReady"] == "1/1"


def test_invalid_spec_creates_nothing_and_says_why(scene: Scene) -> None:
    kube = scene.kube
    bad = manifest("bad", {"leader": 1, "a": 1}, {"wa": ["leader", "ghost"]})
    kube.create(bad)

    status = wait_for("the refusal in the status", lambda: (s := kube.status("bad")).get("phase") and s)
    assert status["phase"] == "Failed"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["SpecValid"]["status"] == "False"
    assert "spec.worlds[0].ranks[1]: member 'ghost' is not declared" in conditions["SpecValid"]["message"]
    assert conditions["Ready"]["status"] == "False"
    event = wait_for("an InvalidSpec event", lambda: [e for e in kube.events("bad") if e.reason == "InvalidSpec"])
    assert event[0].type == "Warning" and "ghost" in event[0].message
    assert kube.pods("bad") == {}
    assert kube.core.list_namespaced_service(kube.namespace).items == []


def test_invalid_edit_keeps_the_running_pods(scene: Scene) -> None:
    kube = scene.kube
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})
    before = kube.uids()

    spec = two_worlds()["spec"]
    spec["worlds"][1]["ranks"] = ["b"]  # a world of 2 pods is fine; one member twice is not
    spec["worlds"][0]["ranks"] = ["leader", "a", "a"]
    kube.patch_spec("mw", spec)

    def refused() -> dict | None:
        status = kube.status()
        valid = next((c for c in status.get("conditions", []) if c["type"] == "SpecValid"), None)
        return status if valid is not None and status.get("observedGeneration") == 2 else None

    status = wait_for("the refusal of generation 2", refused)
    message = next(c["message"] for c in status["conditions"] if c["type"] == "SpecValid")
    assert "spec.worlds[0].ranks[2]: member 'a' appears twice" in message
    assert status["phase"] == "Running"  # the worlds as they were keep going
    assert kube.uids() == before

    kube.patch_spec("mw", two_worlds()["spec"])  # fixed: back to the spec that runs

    def cleared() -> dict | None:
        status = kube.status()
        if status.get("observedGeneration") == 3 and not [c for c in status["conditions"] if c["type"] == "SpecValid"]:
            return status
        return None

    fixed = wait_for("the refusal to clear", cleared)
    assert {w: s["epoch"] for w, s in fixed["worlds"].items()} == {"wa": 1, "wb": 1}
    assert kube.uids() == before


@pytest.mark.parametrize(
    ("field", "value", "path"),
    [
        ("replicas", "two", "spec.members.replicas"),
        ("replicas", 0, "spec.members.replicas"),
        ("name", "Not_A_Label", "spec.members.name"),
    ],
)
def test_crd_schema_refuses_bad_values(
    kube_cluster: Cluster, namespace: str, field: str, value: object, path: str
) -> None:
    """No operator needed: the API server checks the CRD's schema (installed by the chart)."""
    cluster_release(kube_cluster)
    body = two_worlds()
    body["spec"]["members"][0][field] = value
    with kube_cluster.api_client() as api, pytest.raises(ApiException) as refused:
        KubeNamespace(api, namespace).create(body)
    assert refused.value.status == 422
    assert f'"field":"{path}"' in refused.value.body  # 1.20 names list fields without an index
