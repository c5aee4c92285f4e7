"""World-scoped recovery: a failed, deleted or reported-broken world gets a new epoch and only
the pod that is gone (or that a peer's report names) is replaced; every other pod keeps running
(same uid) and learns the new epoch from the world table; the other world is not touched. A
shared pod's death fails every world it is in. An exhausted restart budget fails that world
alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from multiworld.contract import BrokenWorldReport
from multiworld_operator.kube.controller import RESYNC_S
from tests.support.operator_support import TWO_WORLDS_PODS, KubeNamespace, Scene, created_for, two_worlds, wait_for
from tests.support.worker_link import WorkerLink

pytestmark = pytest.mark.kube

PODS = TWO_WORLDS_PODS
B_PODS = {"mw-b-0", "mw-b-1"}


def start(kube: KubeNamespace, **kwargs: Any) -> dict[str, str]:
    kube.create(two_worlds(**kwargs))
    kube.wait_running(epochs={"wa": 1, "wb": 1})
    return kube.uids()


def replaced(kube: KubeNamespace, before: dict[str, str], pods: set[str]) -> dict[str, str]:
    """Until every pod in `pods` is a new instance; returns the uids then."""

    def renewed() -> dict[str, str] | None:
        now = kube.uids()
        return now if set(now) == PODS and all(now[p] != before[p] for p in pods) else None

    return wait_for(f"new instances of {sorted(pods)}", renewed)


def test_exclusive_pod_failure_restarts_its_world_only(scene: Scene) -> None:
    kube = scene.kube
    kubelet = scene.kubelet
    before = start(kube)

    kubelet.fail("mw-a-0")
    status = kube.wait_running(epochs={"wa": 2, "wb": 1})
    after = kube.uids()

    assert after["mw-a-0"] != before["mw-a-0"]  # only the dead pod is new
    assert {p: after[p] for p in PODS - {"mw-a-0"}} == {p: before[p] for p in PODS - {"mw-a-0"}}
    pods = kube.pods()
    assert created_for(pods["mw-a-0"]) == {"wa": 2}
    assert created_for(pods["mw-a-1"]) == {"wa": 1}  # it stayed; the table moved on
    assert created_for(pods["mw-leader-0"]) == {"wa": 1, "wb": 1}
    table = {name: w["epoch"] for name, w in kube.table().items()}
    assert table == {"wa": 2, "wb": 1}
    wa = status["worlds"]["wa"]
    assert (wa["restarts"], status["worlds"]["wb"]["restarts"], status["restarts"]) == (1, 0, 1)
    failure = wa["lastFailure"]
    assert (failure["reason"], failure["pod"], failure["rank"], failure["epoch"]) == ("PodFailed", "mw-a-0", 1, 1)
    assert wait_for(
        "WorldFailed and WorldRecovered events", lambda: {"WorldFailed", "WorldRecovered"} <= set(kube.event_reasons())
    )
    failed = [e for e in kube.events() if e.reason == "WorldFailed"]
    assert len(failed) == 1 and failed[0].type == "Warning" and "world wa epoch 1" in failed[0].message


def test_shared_pod_failure_restarts_every_world_it_is_in(scene: Scene) -> None:
    kube = scene.kube
    kubelet = scene.kubelet
    before = start(kube)

    kubelet.fail("mw-leader-0")
    kube.wait_running(epochs={"wa": 2, "wb": 2})

    after = replaced(kube, before, {"mw-leader-0"})  # both worlds failed; only the dead pod is new
    assert created_for(kube.pods()["mw-leader-0"]) == {"wa": 2, "wb": 2}
    assert {p: after[p] for p in PODS - {"mw-leader-0"}} == {p: before[p] for p in PODS - {"mw-leader-0"}}


def test_deleted_pod_counts_as_failed(scene: Scene) -> None:
    kube = scene.kube
    before = start(kube)

    kube.core.delete_namespaced_pod("mw-b-1", kube.namespace)
    status = kube.wait_running(epochs={"wa": 1, "wb": 2})

    after = replaced(kube, before, {"mw-b-1"})
    assert {p: after[p] for p in PODS - {"mw-b-1"}} == {p: before[p] for p in PODS - {"mw-b-1"}}
    failure = status["worlds"]["wb"]["lastFailure"]
    assert (failure["reason"], failure["pod"], failure["rank"]) == ("PodDeleted", "mw-b-1", 2)


def test_member_report_restarts_the_reported_world(scene: Scene, tmp_path: Path) -> None:
    kube = scene.kube
    before = start(kube)

    report = BrokenWorldReport(world="wa", epoch=1, reason="all_reduce timed out", peer_rank=2, pod="mw-leader-0")
    with WorkerLink(kube.core, kube.namespace, "mw-leader-0", tmp_path) as leader:
        leader.report(report)
        status = kube.wait_running(epochs={"wa": 2, "wb": 1})

    after = replaced(kube, before, {"mw-a-1"})  # the pod the report names
    assert {p: after[p] for p in PODS - {"mw-a-1"}} == {p: before[p] for p in PODS - {"mw-a-1"}}
    failure = status["worlds"]["wa"]["lastFailure"]
    assert (failure["reason"], failure["pod"], failure["rank"], failure["epoch"]) == ("WorldBroken", "mw-a-1", 2, 1)
    assert "all_reduce timed out (reported by mw-leader-0)" == failure["message"]


def test_exhausted_world_fails_alone(scene: Scene) -> None:
    kube = scene.kube
    kubelet = scene.kubelet
    before = start(kube, policy={"maxRestarts": 1, "window": "1h"})

    kubelet.fail("mw-a-0")
    kube.wait_running(epochs={"wa": 2, "wb": 1})
    kubelet.fail("mw-a-1")
    status = kube.wait_world("wa", lambda w: w["phase"] == "Failed", "Failed")

    assert status["phase"] == "Degraded"
    assert status["worlds"]["wb"]["phase"] == "Running" and status["worlds"]["wb"]["epoch"] == 1
    assert list(kube.table()) == ["wb"]
    assert {c["type"]: c["status"] for c in status["conditions"]} == {"Ready": "False", "Degraded": "True"}
    remaining = kube.wait_pods({"mw-leader-0", *B_PODS})  # a pod of a Failed world only is removed
    assert {p: pod.metadata.uid for p, pod in remaining.items()} == {p: before[p] for p in remaining}
    assert wait_for("a WorldExhausted event", lambda: "WorldExhausted" in kube.event_reasons())


def test_backoff_ends_by_requeue(scene: Scene) -> None:
    """A second restart within the window waits for its backoff (its new epoch already in the
    table, for the kept pods to wait in; its new pod made only at the end); the loop
    wakes itself when the planner says (requeue_after), not at the next periodic resync."""
    kube, kubelet = scene.kube, scene.kubelet
    start(kube, policy={"maxRestarts": 5, "window": "1h", "backoff": {"initialDelay": "3s"}})
    kubelet.fail("mw-a-0")
    kube.wait_running(epochs={"wa": 2, "wb": 1})

    kubelet.fail("mw-a-1")
    kube.wait_world("wa", lambda w: w["epoch"] == 3 and "restartAt" in w, "waiting for its backoff")
    assert {world: entry["epoch"] for world, entry in kube.table().items()} == {"wa": 3, "wb": 1}
    # Well under the periodic resync: only a requeue can have ended the backoff this soon.
    wait_for("the backoff to end", lambda: "WorldRestarting" in kube.event_reasons(), timeout=RESYNC_S * 0.75)
    status = kube.wait_running(epochs={"wa": 3, "wb": 1})
    assert status["worlds"]["wa"]["restarts"] == 2
