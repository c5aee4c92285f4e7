"""Two operator replicas with leader election (kube/leadership.py), each `multiworld operator
--leader-election` as a process of its own with the chart's ServiceAccount, serving one
namespace: only the Lease's holder acts; a leader stopped gracefully hands the Lease over at
once; a leader killed (or frozen) is taken over once its Lease lapses, and the MultiWorld goes on
converging under the new leader. The leader's own pod carries the leader label, no other.

Each test fails without leader election: a standby that acts replaces a pod the frozen leader
cannot; without a Lease nobody takes one over."""

from __future__ import annotations

import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.cluster.cluster import Cluster
from tests.support.operator_support import (
    TWO_WORLDS_PODS,
    Kubelet,
    KubeNamespace,
    OperatorReplica,
    Release,
    cluster_release,
    leader_labelled,
    lease_holder,
    refusals,
    two_worlds,
    wait_for,
)

pytestmark = pytest.mark.kube

PODS = TWO_WORLDS_PODS
# How long a frozen leader's standby is watched for acting (it must not): well within any
# Lease duration used here, so the standby cannot have taken the Lease meanwhile.
STANDBY_WATCHED_S = 8.0
# A Lease long enough that a standby taking it "well within" it can only have been handed it:
# waiting out its lapse would take longer than the generous ceiling below.
LONG_LEASE_S = 60
HANDOVER_CEILING_S = LONG_LEASE_S / 2


@dataclass
class Replicas:
    """Two replicas of the operator on one Lease, serving the namespace of `kube`."""

    kube: KubeNamespace
    release: Release
    lease: str
    members: list[OperatorReplica]

    def roles(self) -> tuple[OperatorReplica, OperatorReplica]:
        """(leader, standby), once one of them holds the Lease and carries the leader label."""
        by_name = {r.name: r for r in self.members}
        api, namespace = self.kube.api, self.release.namespace
        holder = wait_for(
            "a replica to hold the Lease", lambda: by_name.get(lease_holder(api, namespace, self.lease) or "")
        )
        (standby,) = [r for r in self.members if r is not holder]
        self.wait_labelled(holder)
        return holder, standby

    def wait_labelled(self, leader: OperatorReplica) -> None:
        names = {r.name for r in self.members}
        wait_for(
            f"only {leader.name} to carry the leader label",
            lambda: leader_labelled(self.kube.api, self.release.namespace) & names == {leader.name} or None,
        )

    def acquired_at(self) -> datetime:
        """When the Lease's holder took it (its own clock: this machine's, as the API server's)."""
        lease = client.CoordinationV1Api(self.kube.api).read_namespaced_lease(self.lease, self.release.namespace)
        assert lease.spec is not None and lease.spec.acquire_time is not None
        return lease.spec.acquire_time


def created_at(pod: client.V1Pod) -> datetime:
    assert pod.metadata is not None and pod.metadata.creation_timestamp is not None
    return pod.metadata.creation_timestamp


@pytest.fixture
def replicas(kube_cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[Callable[[int], Replicas]]:
    """Starts two replicas with a Lease of the given duration (seconds); on exit: no request of
    theirs was refused, and their stand-in pods and the Lease are gone."""
    release = cluster_release(kube_cluster)
    # The Role the chart grants holds the Lease named like the release: the tests take turns on it.
    lease = release.fullname
    started: list[OperatorReplica] = []
    with kube_cluster.api_client() as api, Kubelet(api, namespace):
        kube = KubeNamespace(api, namespace)

        def start(duration_s: int) -> Replicas:
            for role in ("a", "b"):
                name = f"op-{uuid.uuid4().hex[:6]}-{role}"
                started.append(
                    OperatorReplica(api, release, namespace, lease, name, tmp_path / f"{name}.log", duration_s)
                )
            return Replicas(kube, release, lease, list(started))

        try:
            yield start
        finally:
            for replica in started:
                replica.close()
            try:
                client.CoordinationV1Api(api).delete_namespaced_lease(lease, release.namespace)
            except ApiException as error:
                if error.status != 404:
                    raise
    for replica in started:
        assert not refusals(replica.log()), replica.log()[-3000:]
        # Run at INFO (-v): the operator's own lines, none of kopf's (issue 31: noise).
        assert not re.findall(r" INFO kopf\S*: .*", replica.log()), replica.log()[-3000:]


def test_only_the_leader_acts_and_a_graceful_stop_hands_over_at_once(replicas: Callable[[int], Replicas]) -> None:
    pair = replicas(LONG_LEASE_S)
    kube = pair.kube
    leader, standby = pair.roles()
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})

    # The standby acts on nothing: with the leader frozen, a deleted pod stays gone.
    leader.signal(signal.SIGSTOP)
    kube.core.delete_namespaced_pod("mw-a-0", kube.namespace)
    time.sleep(STANDBY_WATCHED_S)
    assert set(kube.pods()) == PODS - {"mw-a-0"}
    leader.signal(signal.SIGCONT)
    kube.wait_running(epochs={"wa": 2, "wb": 1})

    # SIGTERM, as Kubernetes stops a pod: the leader releases the Lease as it exits, and the
    # standby takes it on its next look, not after the Lease's duration.
    leader.signal(signal.SIGTERM)
    assert leader.wait() == 0, leader.log()[-3000:]
    api, namespace = kube.api, pair.release.namespace
    wait_for(
        "the standby to take the released Lease",
        lambda: lease_holder(api, namespace, pair.lease) == standby.name or None,
        HANDOVER_CEILING_S,
    )
    pair.wait_labelled(standby)

    kube.core.delete_namespaced_pod("mw-b-0", kube.namespace)
    status = kube.wait_running(epochs={"wa": 2, "wb": 2})
    assert set(kube.pods()) == PODS
    # Each failure was recovered once: no replica acted beside the other.
    assert [status["worlds"][w]["restarts"] for w in ("wa", "wb")] == [1, 1]


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_lapsed_lease_is_taken_over_and_the_multiworld_converges(
    replicas: Callable[[int], Replicas], fault: str
) -> None:
    """The leader SIGKILLed, or frozen (SIGSTOP) past its Lease: the standby takes over once
    the Lease lapses, and replaces a pod deleted while nobody led; a frozen leader that wakes
    up finds its Lease gone and exits with status 1, acting on nothing."""
    pair = replicas(15)
    kube = pair.kube
    leader, standby = pair.roles()
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})

    leader.signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    kube.core.delete_namespaced_pod("mw-a-0", kube.namespace)
    api, namespace = kube.api, pair.release.namespace
    wait_for(
        "the standby to take the lapsed Lease", lambda: lease_holder(api, namespace, pair.lease) == standby.name or None
    )
    kube.wait_running(epochs={"wa": 2, "wb": 1})
    # Made by the new leader: nobody acted between the kill and the takeover.
    replacement = kube.pods()["mw-a-0"]
    assert created_at(replacement) >= pair.acquired_at().replace(microsecond=0)
    replaced = kube.uids()["mw-a-0"]

    if fault == "frozen":
        leader.signal(signal.SIGCONT)
        assert leader.wait() == 1, leader.log()[-3000:]
        assert "lost" in leader.log()
        pair.wait_labelled(standby)  # the old leader took its label off as it stepped down
    else:  # a killed one cannot: its pod's next container would, as it starts
        wait_for("the new leader's label", lambda: standby.name in leader_labelled(api, namespace) or None)

    # The new leader goes on: a pod deleted after the takeover comes back too.
    kube.core.delete_namespaced_pod("mw-b-0", kube.namespace)
    status = kube.wait_running(epochs={"wa": 2, "wb": 2})
    assert set(kube.pods()) == PODS
    assert [status["worlds"][w]["restarts"] for w in ("wa", "wb")] == [1, 1]
    assert kube.uids()["mw-a-0"] == replaced
