"""The operator keeps no memory that matters: stopped at any moment and started again, it
reads the MultiWorld's status and its pods and converges, with no second epoch bump, no
replacement pod made twice and no pod of a healthy world touched."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import pytest

from tests.cluster.cluster import Cluster
from tests.support.operator_support import (
    TWO_WORLDS_PODS,
    Kubelet,
    KubeNamespace,
    cluster_release,
    created_for,
    running_operator,
    two_worlds,
    wait_for,
)

pytestmark = pytest.mark.kube

PODS = TWO_WORLDS_PODS
# What a failure of mw-a-0 replaces: only that pod (its live peer mw-a-1 stays).
REPLACED = {"mw-a-0"}


@dataclass
class Offline:
    """A namespace with the kubelet stand-in, where the operator comes and goes."""

    kube: KubeNamespace
    kubelet: Kubelet
    operator: Callable[[], AbstractContextManager[object]]


@pytest.fixture
def offline(kube_cluster: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Offline]:
    kubeconfig = cluster_release(kube_cluster).operator_kubeconfig
    with kube_cluster.api_client() as api, Kubelet(api, namespace) as kubelet:
        yield Offline(
            KubeNamespace(api, namespace), kubelet, lambda: running_operator(kubeconfig, namespace, monkeypatch)
        )


def replacements(kube: KubeNamespace) -> dict[str, str]:
    """The pods made for wa's epoch 2, by uid."""
    return {p: pod.metadata.uid for p, pod in kube.pods().items() if created_for(pod) == {"wa": 2}}


@pytest.mark.parametrize("stop_at", ["epoch-bump", "replacements-made"])
def test_restart_in_the_middle_of_a_recovery(offline: Offline, stop_at: str) -> None:
    """Stopped once wa's epoch is bumped (its replacements made or not yet), or once every
    replacement exists (Pending): the next operator finishes the same recovery."""
    kube, kubelet = offline.kube, offline.kubelet
    with offline.operator():
        kube.create(two_worlds())
        kube.wait_running(epochs={"wa": 1, "wb": 1})
        before = kube.uids()
        kubelet.hold.set()  # replacement pods stay Pending: the recovery cannot finish
        kubelet.fail("mw-a-0")
        kube.wait_world("wa", lambda w: w["epoch"] == 2, "epoch 2")
        if stop_at == "replacements-made":
            wait_for("the replacement of mw-a-0", lambda: set(replacements(kube)) == REPLACED or None)
    assert kube.status()["worlds"]["wa"]["phase"] == "Recovering"
    made = replacements(kube)
    if stop_at == "replacements-made":
        assert set(made) == REPLACED

    with offline.operator():
        kubelet.hold.clear()
        status = kube.wait_running(epochs={"wa": 2, "wb": 1})
    after = kube.uids()

    assert set(after) == PODS
    assert (status["worlds"]["wa"]["restarts"], status["restarts"]) == (1, 1)
    assert all(after[p] != before[p] for p in REPLACED)
    assert {p: after[p] for p in PODS - REPLACED} == {p: before[p] for p in PODS - REPLACED}
    assert {p: after[p] for p in made} == made  # made before the restart: kept, not made again


def test_failure_while_the_operator_is_down(offline: Offline) -> None:
    kube = offline.kube
    with offline.operator():
        kube.create(two_worlds())
        kube.wait_running(epochs={"wa": 1, "wb": 1})
        before = kube.uids()

    offline.kubelet.fail("mw-b-0")
    kube.core.delete_namespaced_pod("mw-a-1", kube.namespace)

    with offline.operator():
        status = kube.wait_running(epochs={"wa": 2, "wb": 2})
    after = kube.uids()

    assert (status["worlds"]["wa"]["lastFailure"]["reason"], status["worlds"]["wb"]["lastFailure"]["reason"]) == (
        "PodDeleted",
        "PodFailed",
    )
    assert [status["worlds"][w]["restarts"] for w in ("wa", "wb")] == [1, 1]
    # Only the two pods that went are new; the leader, in both failed worlds, stays.
    gone = {"mw-b-0", "mw-a-1"}
    assert set(after) == PODS and all(after[p] != before[p] for p in gone)
    assert {p: after[p] for p in PODS - gone} == {p: before[p] for p in PODS - gone}
