"""The worker side of the Kubernetes platform, for real: a KubernetesChannel holding only the
workers' ServiceAccount token (the chart's worker Role) follows its pod's part of the world
table (the world ConfigMaps labelled with it), a failure in a world it is not in sends it
nothing, and what it reports on its Pod reaches the operator (itself holding only the chart's
namespaced Role): a WorkerStatus decides readyRanks, a BrokenWorldReport restarts the world.
"""

from __future__ import annotations

import queue

import pytest
from multiworld_test_cluster import Cluster
from operator_support import (
    WAIT_S,
    WORKER_SA,
    Kubelet,
    KubeNamespace,
    install_release,
    running_operator,
    two_worlds,
    wait_for,
)

from multiworld.channels import open_channel
from multiworld.channels.kubernetes import KubernetesChannel, parse_table_url
from multiworld.contract import STATUS_ANNOTATION, BrokenWorldReport, WorkerStatus, WorldTable

pytestmark = pytest.mark.kube

LEADER = "mw-leader-0"


class Tables:
    """What the channel handed to on_table, in order."""

    def __init__(self) -> None:
        self.received: queue.Queue[WorldTable] = queue.Queue()

    def __call__(self, table: WorldTable) -> None:
        self.received.put(table)

    def until(self, epochs: dict[str, int]) -> WorldTable:
        """The first table (from now on) whose worlds are at `epochs`."""
        while True:
            table = self.received.get(timeout=WAIT_S)
            if {w.name: w.epoch for w in table.worlds} == epochs:
                return table


def ready_ranks(kube: KubeNamespace, world: str, phase: str, ranks: int) -> None:
    kube.wait_world(world, lambda w: (w["phase"], w["readyRanks"]) == (phase, ranks), f"{phase} with {ranks} ready")


def test_channel_follows_the_table_and_reaches_the_operator(
    kube_cluster: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The chart in its namespaced mode: a Role for the operator and the workers' identity here.
    release = install_release(kube_cluster, namespace, {"watchNamespaces": [namespace]})
    kube_cluster.serviceaccount_kubeconfig(namespace, WORKER_SA)  # its token exists: pods get admitted
    template = two_worlds()["spec"]["template"]
    template["spec"]["serviceAccountName"] = WORKER_SA

    with (
        kube_cluster.api_client() as admin,
        Kubelet(admin, namespace) as kubelet,
        running_operator(release.operator_kubeconfig, namespace, monkeypatch),
        kube_cluster.serviceaccount_api_client(namespace, WORKER_SA) as worker_api,
    ):
        kube = KubeNamespace(admin, namespace)
        kube.create(two_worlds(template=template))
        kube.wait_running(epochs={"wa": 1, "wb": 1})
        channel = KubernetesChannel(f"kubernetes://{namespace}/mw", LEADER, api=worker_api)
        tables = Tables()
        channel.start(tables)
        # A pod of wb only: wa's failure below must not reach it.
        bystander = KubernetesChannel(f"kubernetes://{namespace}/mw", "mw-b-0", api=worker_api)
        bystander_tables = Tables()
        bystander.start(bystander_tables)
        try:
            first = tables.until({"wa": 1, "wb": 1})
            assert sorted(first.assignments_for(LEADER)) == ["wa", "wb"]
            assert [w.name for w in bystander_tables.until({"wb": 1}).worlds] == ["wb"]
            channel.status(WorkerStatus(pod=LEADER, joined={"wa": 1, "wb": 1}))
            wait_for(
                "the leader's WorkerStatus on its pod",
                lambda: STATUS_ANNOTATION in (kube.pods()[LEADER].metadata.annotations or {}),
            )

            # The operator bumps wa; the channel hands the new table over.
            kubelet.fail("mw-a-0")
            bumped = tables.until({"wa": 2, "wb": 1})
            assert bumped.revision > first.revision
            assert bumped.assignments_for(LEADER)["wa"].epoch == 2
            assert bystander_tables.received.empty()
            # The new a pods run, but the leader's status still holds wa at epoch 1: not whole.
            ready_ranks(kube, "wa", "Recovering", 2)
            channel.status(WorkerStatus(pod=LEADER, joined={"wa": 2, "wb": 1}))
            ready_ranks(kube, "wa", "Running", 3)

            # The leader reports wb broken (its peer at rank 1 timed out): wb restarts.
            before = kube.uids()
            channel.report(BrokenWorldReport(world="wb", epoch=1, reason="recv timed out", peer_rank=1, pod=LEADER))
            tables.until({"wa": 2, "wb": 2})
            failure = kube.wait_world("wb", lambda w: w["epoch"] == 2, "epoch 2")["worlds"]["wb"]["lastFailure"]
            assert (failure["reason"], failure["pod"], failure["rank"]) == ("WorldBroken", "mw-b-0", 1)
            channel.status(WorkerStatus(pod=LEADER, joined={"wa": 2, "wb": 2}))
            kube.wait_running(epochs={"wa": 2, "wb": 2})
            assert kube.uids()[LEADER] == before[LEADER]
            events = kube.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={LEADER}").items
            assert [(e.reason, e.type) for e in events] == [("WorldBroken", "Warning")]
            assert "world wb epoch 1 broken (peer rank 1): recv timed out" == events[0].message
            assert bystander_tables.until({"wb": 2}).worlds[0].epoch == 2  # its own world's bump reaches it
        finally:
            channel.close()
            bystander.close()
        assert not any(thread.is_alive() for thread in channel._threads)


def test_channel_url() -> None:
    assert parse_table_url("kubernetes://team-a/mw") == ("team-a", "mw")
    for bad in ("kubernetes://", "kubernetes://ns", "kubernetes://ns/", "kubernetes://ns/a/b", "local://ns/mw"):
        with pytest.raises(ValueError, match="MULTIWORLD_TABLE"):
            parse_table_url(bad)
    with pytest.raises(ValueError, match="NAMESPACE/NAME"):
        open_channel("kubernetes://only-a-namespace", LEADER)


# A worker process that only follows its table: what init_from_env starts in every pod.
FOLLOW_TABLE = """
import sys, time
from multiworld.channels import open_channel
channel = open_channel(sys.argv[1], "mw-leader-0")
channel.start(lambda table: None)
time.sleep(120)
"""


def test_a_worker_without_its_permissions_exits_saying_which_and_how(kube_cluster: Cluster, namespace: str) -> None:
    """401/403 never heal by retrying: a worker running as a ServiceAccount without the
    workers' Role exits at once (status 77), naming the permission and the fix."""
    import os
    import subprocess
    import sys

    kubeconfig = kube_cluster.serviceaccount_kubeconfig(namespace, "default")
    result = subprocess.run([sys.executable, "-c", FOLLOW_TABLE, f"kubernetes://{namespace}/mw"],
                            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                            capture_output=True, text=True, timeout=100, check=False)  # fmt: skip
    assert result.returncode == 77, result.stderr
    assert (
        "refused this worker (403 Forbidden): its ServiceAccount may not get, list and watch configmaps"
        in result.stderr
    ), result.stderr
    assert "`serviceAccountName: multiworld-worker`" in result.stderr
