"""The worker side of the Kubernetes platform, for real: the worker library's channel, holding a
token the API server bound to its pod, follows that pod's part of the world table as the
operator serves it, a failure in a world it is not in sends it nothing, and what it says reaches
the operator (a WorkerStatus decides readyRanks, a BrokenWorldReport restarts the world).

And the trust boundary, each attack carried out for real: a worker speaks only for its own pod
(a hello naming another pod, or carrying no token, is refused), only for the worlds that pod
holds a rank in and only at their current epoch (a forged report is ignored and said on the
MultiWorld by a Warning Event naming the pod), and the workers' ServiceAccount may write nothing
(patching another pod's image is refused by the API server).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from multiworld.channels.stream import parse_url
from multiworld.contract import (
    ENV_WORLDS,
    BrokenWorldReport,
    ChannelMessage,
    Hello,
    WorkerStatus,
    WorldEntry,
    WorldTable,
)
from multiworld_operator.kube.client.api_basics import MERGE_PATCH
from tests.cluster.cluster import Cluster
from tests.support import worker_link
from tests.support.operator_support import (
    WORKER_SA,
    Kubelet,
    KubeNamespace,
    env_of,
    install_release,
    running_operator,
    two_worlds,
    wait_for,
)
from tests.support.worker_link import WorkerLink, channel_url, pod_token

pytestmark = pytest.mark.kube

LEADER = "mw-leader-0"
WAIT_S = 120.0
ChartScene = tuple[KubeNamespace, Kubelet]


def epochs(table: WorldTable) -> dict[str, int]:
    return {w.name: w.epoch for w in table.worlds}


def until(link: WorkerLink, wanted: dict[str, int]) -> WorldTable:
    return wait_for(f"a table at {wanted}", lambda: next((t for t in link.tables if epochs(t) == wanted), None))


def ready_ranks(kube: KubeNamespace, world: str, phase: str, ranks: int) -> None:
    kube.wait_world(world, lambda w: (w["phase"], w["readyRanks"]) == (phase, ranks), f"{phase} with {ranks} ready")


def refused_events(kube: KubeNamespace) -> list[str]:
    return [e.message for e in kube.events() if e.reason == "ReportRefused" and e.type == "Warning"]


def two(messages: list[str]) -> list[str] | None:
    return messages if len(messages) == 2 else None


def hello_answer(kube: KubeNamespace, hello: Hello) -> ChannelMessage:
    """What the operator answers a raw connection that opens with `hello`."""
    _, host, port = parse_url(channel_url(kube.core, kube.namespace, LEADER))
    return worker_link.hello_answer(host, port, hello, WAIT_S)


@pytest.fixture
def chart_scene(
    kube_cluster: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[KubeNamespace, Kubelet]]:
    """The chart in its namespaced mode (a Role for the operator here, the workers' ServiceAccount
    with none), the operator serving this namespace, two worlds running, pods as the workers'
    ServiceAccount."""
    release = install_release(kube_cluster, namespace, {"watchNamespaces": [namespace]})
    kube_cluster.serviceaccount_kubeconfig(namespace, WORKER_SA)  # its token exists: pods get admitted
    template = two_worlds()["spec"]["template"]
    template["spec"]["serviceAccountName"] = WORKER_SA
    with (
        kube_cluster.api_client() as admin,
        Kubelet(admin, namespace) as kubelet,
        running_operator(release.operator_kubeconfig, namespace, monkeypatch),
    ):
        kube = KubeNamespace(admin, namespace)
        kube.create(two_worlds(template=template))
        kube.wait_running(epochs={"wa": 1, "wb": 1})
        yield kube, kubelet


def test_channel_follows_the_table_and_reaches_the_operator(chart_scene: ChartScene, tmp_path: Path) -> None:
    kube, kubelet = chart_scene
    # A pod of wb only: wa's failure below must not reach it.
    with (
        WorkerLink(kube.core, kube.namespace, LEADER, tmp_path) as leader,
        WorkerLink(kube.core, kube.namespace, "mw-b-0", tmp_path) as bystander,
    ):
        first = until(leader, {"wa": 1, "wb": 1})
        assert sorted(first.assignments_for(LEADER)) == ["wa", "wb"]
        # Each entry carries its world's secret at its epoch, the one the pod's env gave it.
        pod = kube.core.read_namespaced_pod(LEADER, kube.namespace)
        started = {a["name"]: a["secret"] for a in json.loads(env_of(pod)[ENV_WORLDS])}
        assert {w.name: w.secret for w in first.worlds} == started and all(started.values())
        until(bystander, {"wb": 1})
        leader.status(WorkerStatus(pod=LEADER, joined={"wa": 1, "wb": 1}))

        # The operator bumps wa; the channel hands the new table over, and nothing to the bystander.
        seen_by_bystander = len(bystander.tables)
        kubelet.fail("mw-a-0")
        bumped = until(leader, {"wa": 2, "wb": 1})
        assert bumped.assignments_for(LEADER)["wa"].epoch == 2
        # The new a pods run, but the leader's status still holds wa at epoch 1: not whole.
        ready_ranks(kube, "wa", "Recovering", 2)
        leader.status(WorkerStatus(pod=LEADER, joined={"wa": 2, "wb": 1}))
        ready_ranks(kube, "wa", "Running", 3)
        assert len(bystander.tables) == seen_by_bystander

        # The leader reports wb broken (its peer at rank 1 timed out): wb restarts.
        before = kube.uids()
        leader.report(BrokenWorldReport(world="wb", epoch=1, reason="recv timed out", peer_rank=1, pod=LEADER))
        until(leader, {"wa": 2, "wb": 2})
        failure = kube.wait_world("wb", lambda w: w["epoch"] == 2, "epoch 2")["worlds"]["wb"]["lastFailure"]
        assert (failure["reason"], failure["pod"], failure["rank"]) == ("WorldBroken", "mw-b-0", 1)
        leader.status(WorkerStatus(pod=LEADER, joined={"wa": 2, "wb": 2}))
        kube.wait_running(epochs={"wa": 2, "wb": 2})
        assert kube.uids()[LEADER] == before[LEADER]
        # mw-b-0, the culprit, was replaced: its old instance, still connected, gets no later table,
        # and so no world's secret at an epoch it holds no rank in (issue 32, finding 5).
        assert kube.uids()["mw-b-0"] != before["mw-b-0"]
        assert [epochs(t) for t in bystander.tables if epochs(t) != {"wb": 1}] == []
        # Its world's bump reaches the pod's new instance.
        (tmp_path / "successor").mkdir()  # its own token file: the old link reads its own
        with WorkerLink(kube.core, kube.namespace, "mw-b-0", tmp_path / "successor") as successor:
            assert until(successor, {"wb": 2}).worlds[0].secret
    assert refused_events(kube) == []


def test_a_worker_cannot_speak_for_worlds_it_is_not_in_nor_for_epochs_to_come(
    chart_scene: ChartScene, tmp_path: Path
) -> None:
    kube, _ = chart_scene
    uids = kube.uids()
    with (
        WorkerLink(kube.core, kube.namespace, "mw-b-0", tmp_path) as intruder,
        WorkerLink(kube.core, kube.namespace, LEADER, tmp_path) as leader,
    ):
        until(intruder, {"wb": 1})
        until(leader, {"wa": 1, "wb": 1})
        # A pod of wb only reports wa broken, for every epoch to come (today's code took them all,
        # and drove wa through its whole restart budget).
        for epoch in range(1, 6):
            intruder.report(BrokenWorldReport(world="wa", epoch=epoch, reason="forged", pod="mw-b-0"))
        # The leader holds a rank in wb, but wb has not reached epoch 5.
        leader.report(BrokenWorldReport(world="wb", epoch=5, reason="from the future", pod=LEADER))
        messages = wait_for("two ReportRefused Events", lambda: two(refused_events(kube)))
    assert any("pod mw-b-0 reported world wa broken" in m and "holds no rank in" in m for m in messages), messages
    assert any(f"pod {LEADER} reported world wb broken at epoch 5" in m for m in messages), messages
    status = kube.status()
    assert {w: status["worlds"][w]["epoch"] for w in ("wa", "wb")} == {"wa": 1, "wb": 1}
    assert kube.uids() == uids


def test_a_decoy_table_reaches_no_worker(chart_scene: ChartScene, tmp_path: Path) -> None:
    """A ConfigMap shaped as the old world table (wa at epoch 9, with another store host), made
    by someone with the rights to: workers take their table only from the operator's channel,
    so the next real change (wb restarts) reaches the leader with wa untouched."""
    kube, kubelet = chart_scene
    entry = WorldEntry(name="wa", epoch=9, host="attacker.example", port=20001, pods=[LEADER, "mw-a-0", "mw-a-1"])
    decoy = client.V1ConfigMap(
        metadata=client.V1ObjectMeta(
            name="mw.wa",
            labels={"multiworld.io/name": "mw", "multiworld.io/world": "wa", f"pod.multiworld.io/{LEADER}": "0"},
        ),
        data={"entry.json": entry.model_dump_json()},
    )
    kube.core.create_namespaced_config_map(kube.namespace, decoy)
    with WorkerLink(kube.core, kube.namespace, LEADER, tmp_path) as leader:
        until(leader, {"wa": 1, "wb": 1})
        kubelet.fail("mw-b-0")
        table = until(leader, {"wa": 1, "wb": 2})
    wa = table.assignments_for(LEADER)["wa"]
    assert (wa.epoch, wa.host) == (1, "mw-leader-0.mw")


def test_a_worker_speaks_only_for_its_own_pod(chart_scene: ChartScene) -> None:
    kube, _ = chart_scene
    bystander_token = pod_token(kube.core, kube.namespace, "mw-b-0")
    answer = hello_answer(kube, Hello(pod=LEADER, token=bystander_token))
    assert answer.refused == f"the hello names pod {LEADER}, the token is pod mw-b-0's"
    assert "sent no token" in (hello_answer(kube, Hello(pod=LEADER)).refused or "")
    assert "was not accepted" in (hello_answer(kube, Hello(pod=LEADER, token="not.a.token")).refused or "")


def test_the_workers_serviceaccount_may_write_nothing(chart_scene: ChartScene, kube_cluster: Cluster) -> None:
    """As the workers' ServiceAccount: patching another pod's image (a mutable field: it would run
    other code under that pod's identity), annotating a pod, writing a ConfigMap: all refused."""
    kube, _ = chart_scene
    with kube_cluster.serviceaccount_api_client(kube.namespace, WORKER_SA) as worker_api:
        core = client.CoreV1Api(worker_api)
        attempts = {
            "patch another pod's image": lambda: core.patch_namespaced_pod(
                "mw-a-0",
                kube.namespace,
                {"spec": {"containers": [{"name": "worker", "image": "attacker/image"}]}},
                _content_type=MERGE_PATCH,
            ),
            "annotate a pod": lambda: core.patch_namespaced_pod(
                LEADER, kube.namespace, {"metadata": {"annotations": {"x": "y"}}}, _content_type=MERGE_PATCH
            ),
            "create a ConfigMap": lambda: core.create_namespaced_config_map(
                kube.namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="decoy"), data={})
            ),
            "delete a pod": lambda: core.delete_namespaced_pod("mw-a-1", kube.namespace),
        }
        for what, attempt in attempts.items():
            with pytest.raises(ApiException) as refused:
                attempt()
            assert refused.value.status == 403, what
    assert kube.pods()["mw-a-0"].spec.containers[0].image != "attacker/image"


def test_a_deleted_or_edited_network_policy_is_restored(chart_scene: ChartScene) -> None:
    kube, _ = chart_scene
    networking = client.NetworkingV1Api(kube.api)

    def policy() -> client.V1NetworkPolicy | None:
        return kube.network_policy()

    made = wait_for("the NetworkPolicy", policy)
    networking.delete_namespaced_network_policy("mw", kube.namespace)

    def renewed() -> client.V1NetworkPolicy | None:
        found = policy()
        return found if found is not None and found.metadata.uid != made.metadata.uid else None

    restored = wait_for("the NetworkPolicy restored", renewed)
    assert restored.spec == made.spec
    networking.patch_namespaced_network_policy(
        "mw",
        kube.namespace,
        {"spec": {"ingress": [{}]}},
        _content_type=MERGE_PATCH,  # open to everyone
    )
    wait_for("the NetworkPolicy's spec restored", lambda: (found := policy()) is not None and found.spec == made.spec)
