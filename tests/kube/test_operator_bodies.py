"""The Kubernetes platform's pure parts, no API server: world ports, what a pod listing means
to the planner, the pod cache, which worker reports count, pods lost with their hosts, the
memory's ConfigMap, and the status of an invalid spec."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, strategies as st

from multiworld.contract import (
    BrokenWorldReport,
    WorkerStatus,
    WorldEntry,
    WorldTable,
)
from multiworld_operator.kube.memory.planner_memory import MEMORY_KEY, memory_body, read_memory
from multiworld_operator.kube.objects import observe
from multiworld_operator.kube.objects.bodies import CREATED_FOR_ANNOTATION, pod_body
from multiworld_operator.kube.objects.observe import observe_pods, pod_addresses
from multiworld_operator.kube.objects.pod_cache import PodCache
from multiworld_operator.kube.objects.ports import preferred_port, world_ports
from multiworld_operator.kube.reporting.refusal import refusal_patch
from multiworld_operator.kube.workers.lost_hosts import AVOID_S, MAX_REPLACED, LostHosts
from multiworld_operator.kube.workers.worker_inbox import WorkerInbox
from multiworld_operator.planner import CreatePod, MultiWorldStatus, Observation, plan
from multiworld_operator.spec import MultiWorld, parse_manifest
from multiworld_operator.spec.limits import PORT_BASE, PORT_SPAN
from tests.support.operator_support import manifest

pytestmark = pytest.mark.quick

OWNER = "uid-of-mw"
NOW = datetime(2030, 1, 1, tzinfo=UTC)

PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def star(worlds: list[str], name: str = "mw") -> MultiWorld:
    """Every world's rank 0 is the same leader pod."""
    members = {"leader": 1, **{f"m-{w}": 1 for w in worlds}}
    return parse_manifest(manifest(name, members, {w: ["leader", f"m-{w}"] for w in worlds}))


def table_of(multiworld: MultiWorld, ports: dict[str, int]) -> MultiWorldStatus:
    return plan(multiworld, None, Observation(now=NOW), endpoint=lambda w, pod: (pod, ports[w])).status


world_names = st.lists(st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True), min_size=1, max_size=12, unique=True)


@given(world_names, world_names)
def test_ports_distinct_on_a_shared_rank0_and_stable_across_edits(first: list[str], added: list[str]) -> None:
    before = star(first)
    ports = world_ports(before, None)
    assert len(set(ports.values())) == len(first)
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports.values())

    edited = star(first + [w for w in added if w not in first])
    again = world_ports(edited, table_of(before, ports).table)
    assert {w: again[w] for w in first} == ports
    assert len(set(again.values())) == len(again)


def test_colliding_world_takes_the_next_free_port() -> None:
    multiworld = star(["alpha", "beta"])
    beta = preferred_port(multiworld, "beta")
    previous = table_of(multiworld, {"alpha": beta, "beta": beta}).table
    # beta's own spot is held by alpha (kept from the previous table): beta moves one up.
    ports = world_ports(multiworld, previous.model_copy(update={"worlds": previous.worlds[:1]}))
    assert ports == {"alpha": beta, "beta": PORT_BASE + (beta - PORT_BASE + 1) % PORT_SPAN}


def test_worlds_named_alike_in_two_multiworlds_prefer_different_ports() -> None:
    """Pods of hostNetwork share their node's ports: world1 of one MultiWorld must not take
    world1's port of every other MultiWorld on the node."""
    worlds = ["world1", "world2"]
    ports = [world_ports(star(worlds, name), None) for name in ("mw", "other")]
    assert all(ports[0][w] != ports[1][w] for w in worlds), ports


def pod(name: str, phase: str = "Running", owner: str = OWNER, **meta: object) -> dict:
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "ownerReferences": [{"uid": owner, "controller": True}],
            "labels": {"multiworld.io/member": "a", "multiworld.io/ordinal": "1"},
            **meta,
        },
        "status": {"phase": phase},
    }


def test_observation_of_a_listing() -> None:
    report = BrokenWorldReport(world="wa", epoch=1, reason="timeout", peer_rank=0, pod="mw-a-1", time=NOW)
    # What a worker could once write on a pod counts for nothing: its status comes from the channel.
    forged = {"multiworld.io/worker-status": WorkerStatus(pod="mw-a-0", joined={"wa": 9}).model_dump_json()}
    cache = PodCache(OWNER)
    cache.listed(
        [
            pod("mw-a-1", annotations={CREATED_FOR_ANNOTATION: json.dumps({"wa": 1})}),
            pod("mw-a-0", "Unknown", annotations={CREATED_FOR_ANNOTATION: "not json", **forged}),
            pod("mw-b-0", deletionTimestamp="2030-01-01T00:00:00Z"),
            pod("mw-b-1", owner="uid-of-an-older-mw"),
        ],
        "100",
    )
    workers = {
        "uid-mw-a-1": WorkerStatus(pod="mw-a-1", joined={"wa": 1}),
        "uid-of-a-replaced-mw-a-0": WorkerStatus(pod="mw-a-0", joined={"wa": 1}),
    }
    seen = observe_pods(cache.pods(), workers, [report])

    by_name = {p.name: p for p in seen.pods}
    assert set(by_name) == {"mw-a-1", "mw-a-0"}  # terminating and foreign pods are not ours now
    assert (by_name["mw-a-1"].member, by_name["mw-a-1"].ordinal, by_name["mw-a-1"].phase) == ("a", 1, "Running")
    assert by_name["mw-a-1"].created_for == {"wa": 1} and by_name["mw-a-1"].joined == {"wa": 1}
    assert by_name["mw-a-0"].phase == "Pending"
    # Unreadable stamp: ignored; the status of another instance of that name: not this one's.
    assert by_name["mw-a-0"].created_for == {} and by_name["mw-a-0"].joined is None
    assert seen.reports == [report]
    assert seen.present == {n: f"uid-{n}" for n in ("mw-a-1", "mw-a-0", "mw-b-0", "mw-b-1")}
    assert seen.terminating == {"mw-b-0"}


def test_an_instance_lost_with_its_host_has_ended_for_the_planner() -> None:
    """The API still says Running (the node's kubelet is silent, not dead to Kubernetes yet); the
    planner sees the lost instance Failed, saying which node went and when, and every other
    instance on that node (one placed there before the loss was known too), but none that had
    ended already or is being deleted, nor any elsewhere; a lost instance no longer there is
    forgotten, and the node is said once."""
    cache = PodCache(OWNER)
    placed = [
        (pod("mw-a-0"), "node-2"),
        (pod("mw-a-1", "Succeeded"), "node-2"),
        (pod("mw-b-0", deletionTimestamp="2030-01-01T00:00:00Z"), "node-2"),
        (pod("mw-b-1"), "node-1"),
    ]
    cache.listed([{**item, "spec": {"nodeName": node}} for item, node in placed], "100")
    assert {p.name: p.node for p in cache.pods()}["mw-a-0"] == "node-2"
    lost = LostHosts()
    assert lost.lost("uid-mw-a-0", "mw-a-0", "node-2", NOW)
    assert not lost.lost("uid-mw-a-0", "mw-a-0", "node-2", NOW + timedelta(seconds=1))  # heard once
    assert lost.lost("uid-of-a-gone-instance", "mw-c-0", "node-2", NOW)
    assert lost.take_news() == [
        "node node-2 lost at 2030-01-01T00:00:00Z: the connection of pod mw-a-0's worker there went "
        f"unacknowledged; every pod there is replaced on another node, and new pods are kept off it for "
        f"{AVOID_S:.0f} s"
    ]
    assert lost.take_news() == []  # said once
    reasons = lost.reasons({p.uid: p.node for p in cache.pods()})
    # Every instance on the lost node is lost with it, heard or not; none elsewhere (mw-b-0,
    # being deleted, is not the cache's).
    assert set(reasons) == {"uid-mw-a-0", "uid-mw-a-1"}
    by_name = {p.name: p for p in observe_pods(cache.pods(), {}, [], lost=reasons).pods}
    assert (by_name["mw-a-0"].phase, by_name["mw-a-1"].phase, by_name["mw-b-1"].phase) == (
        "Failed",
        "Succeeded",
        "Running",
    )
    assert by_name["mw-a-0"].message.startswith("lost with node node-2 at 2030-01-01T00:00:00Z: its worker's "), by_name
    assert "mw-b-0" not in by_name  # being deleted: gone for the planner anyway
    # A replacement placed on the lost node before the loss was known never starts: lost too.
    assert lost.reasons({"uid-new": "node-2", "uid-pending": ""}) == {
        "uid-new": "lost with node node-2 at 2030-01-01T00:00:00Z: a worker's connection there went "
        "unacknowledged (powered off or cut off the network)"
    }


def test_a_replaced_instance_found_lost_names_its_node() -> None:
    """Peers name a silent pod within a second and it is replaced; its connection times out
    seconds later, when the cache no longer has it: its node is remembered from the replacement."""
    lost = LostHosts()
    lost.replaced("uid-old", "node-3", NOW)
    lost.replaced("uid-unplaced", "", NOW)
    assert lost.lost("uid-old", "mw-a-0", "", NOW)
    assert lost.avoid(NOW) == ["node-3"]
    assert [m.split(":")[0] for m in lost.take_news()] == ["node node-3 lost at 2030-01-01T00"]
    assert lost.lost("uid-unplaced", "mw-a-1", "", NOW)  # where is unknown: no node to avoid
    assert lost.avoid(NOW) == ["node-3"] and lost.take_news() == []
    for n in range(MAX_REPLACED + 1):
        lost.replaced(f"uid-{n}", "node-4", NOW)
    lost.lost("uid-0", "mw-b-0", "", NOW)  # forgotten: the oldest beyond MAX_REPLACED
    assert lost.avoid(NOW) == ["node-3"]


def test_a_lost_node_is_kept_out_of_new_pods_for_a_while() -> None:
    """Each of the template's node selector terms rules the lost nodes out (they are ORed), by
    name; the template's own affinity stays; AVOID_S later a new pod may go there again."""
    lost = LostHosts()
    lost.lost("uid-1", "mw-a-0", "node-2", NOW)
    lost.lost("uid-2", "mw-a-1", "node-3", NOW + timedelta(seconds=10))
    lost.lost("uid-3", "mw-a-2", "", NOW)  # never placed: no node to avoid
    assert lost.avoid(NOW + timedelta(seconds=5)) == ["node-2", "node-3"]
    assert lost.avoid(NOW + timedelta(seconds=AVOID_S + 5)) == ["node-3"]
    assert lost.avoid(NOW + timedelta(seconds=AVOID_S + 15)) == []

    multiworld = {"metadata": {"name": "mw", "namespace": "ns", "uid": OWNER}}
    zone = {"key": "zone", "operator": "In", "values": ["a"]}
    preferred = [{"weight": 1, "preference": {"matchExpressions": [zone]}}]
    template: dict[str, Any] = {
        "spec": {
            "containers": [{"name": "c"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [zone]}, {"matchFields": [zone]}]
                    },
                    "preferredDuringSchedulingIgnoredDuringExecution": preferred,
                },
                "podAntiAffinity": {"x": 1},
            },
        }
    }
    action = CreatePod(pod="mw-a-0", member="a", ordinal=0, created_for={}, worlds=[], template=template)
    off = {"key": "metadata.name", "operator": "NotIn", "values": ["node-2", "node-3"]}
    affinity = pod_body(action, multiworld, "operator://o:1", avoid_nodes=["node-3", "node-2"])["spec"]["affinity"]
    assert affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [zone], "matchFields": [off]},
        {"matchFields": [zone, off]},
    ]
    assert affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
    assert affinity["podAntiAffinity"] == {"x": 1}
    assert template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchExpressions": [zone]}, {"matchFields": [zone]}]
    }  # not mutated
    bare = CreatePod(pod="mw-b-0", member="b", ordinal=0, created_for={}, worlds=[], template={"spec": {}})
    assert pod_body(bare, multiworld, "operator://o:1", avoid_nodes=["node-2"])["spec"]["affinity"] == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [{**off, "values": ["node-2"]}]}]
            }
        }
    }
    assert "affinity" not in pod_body(bare, multiworld, "operator://o:1")["spec"]
    rather_spec = pod_body(action, multiworld, "operator://o:1", prefer_off=["node-5"])["spec"]
    rather = rather_spec["affinity"]["nodeAffinity"]
    away = {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node-5"]}]}
    assert rather["preferredDuringSchedulingIgnoredDuringExecution"] == [
        *preferred,
        {"weight": 100, "preference": away},
    ]
    # The scheduler's default spread (over the Service's pods) would pull it to the emptied node:
    # it spreads with its member's pods instead, unless the template says how to spread.
    assert rather_spec["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"multiworld.io/name": "mw", "multiworld.io/member": action.member}},
        }
    ]
    own = [{"maxSkew": 2, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]
    spread = CreatePod(**{**bare.model_dump(), "template": {"spec": {"topologySpreadConstraints": own}}})
    assert (
        pod_body(spread, multiworld, "operator://o:1", prefer_off=["node-5"])["spec"]["topologySpreadConstraints"]
        == own
    )
    assert "topologySpreadConstraints" not in pod_body(action, multiworld, "operator://o:1")["spec"]


def test_a_node_where_an_instance_went_silent_is_rather_avoided() -> None:
    """Peers name a silent pod before its node is known lost: its replacement rather goes to
    another node (a preference: a frozen process may sit on a healthy node), for AVOID_S, and
    a node lost since is ruled out instead."""
    lost = LostHosts()
    lost.replaced("uid-crashed", "node-1", NOW)
    lost.replaced("uid-silent", "node-2", NOW, silent=True)
    assert lost.suspected(NOW) == ["node-2"]
    assert lost.suspected(NOW + timedelta(seconds=AVOID_S + 1)) == []
    lost.replaced("uid-silent-again", "node-2", NOW, silent=True)
    lost.lost("uid-x", "mw-x-0", "node-2", NOW)
    assert lost.avoid(NOW) == ["node-2"] and lost.suspected(NOW) == []


def test_a_tenants_annotation_is_ignored_at_a_bounded_cost_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """A tenant may write a pod's annotations (256 KiB of them) as often as it likes: a stamp that
    is not ours is ignored; one longer than ours ever is is not even parsed; each is said once a
    minute per pod, however often the pod is seen."""
    huge = "[" + "1," * (observe.MAX_ANNOTATION // 2) + "1]"
    versions = [
        pod("mw-junk-0", annotations={CREATED_FOR_ANNOTATION: "not json"}, resourceVersion=str(n)) for n in range(50)
    ] + [pod("mw-huge-0", annotations={CREATED_FOR_ANNOTATION: huge}, resourceVersion=str(n)) for n in range(50)]
    with caplog.at_level(logging.WARNING, logger=observe.__name__):
        started = time.perf_counter()
        seen = [observe.see_pod(item, OWNER) for item in versions]
        took = time.perf_counter() - started
    assert all(p.observation is not None and p.observation.created_for == {} for p in seen)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "pod mw-junk-0: ignoring annotation multiworld.io/created-for: " in said[0], said
    assert said[1] == f"pods: pod mw-huge-0: ignoring annotation multiworld.io/created-for: {len(huge)} characters"
    print(f"\n100 observations of pods with a junk or a {len(huge) // 1024} KiB stamp: {took * 1000:.1f} ms")


def test_a_report_counts_only_from_a_rank_of_its_world_at_its_current_epoch() -> None:
    def entry(name: str, epoch: int) -> WorldEntry:
        return WorldEntry(
            name=name, epoch=epoch, host="mw-leader-0.mw", port=4000, pods=["mw-leader-0", f"mw-{name}-0"]
        )

    table = WorldTable(worlds=[entry("wa", 2), entry("wb", 1)])

    def broken(world: str, epoch: int) -> BrokenWorldReport:
        return BrokenWorldReport(world=world, epoch=epoch, reason="recv timed out", time=NOW)

    inbox = WorkerInbox()
    assert inbox.report("mw-leader-0", broken("wa", 2), table)
    assert not inbox.report("mw-wa-0", broken("wa", 1), table)  # crossed the new table in flight: quietly dropped
    assert not inbox.report("mw-wb-0", broken("wa", 2), table)  # not in wa
    assert not inbox.report("mw-wb-0", broken("wa", 3), table)  # said once per pod and world
    assert not inbox.report("mw-leader-0", broken("wb", 7), table)  # an epoch wb has not reached
    refusals = inbox.take_refusals()
    assert len(refusals) == 2 and inbox.take_refusals() == []
    assert "pod mw-wb-0 reported world wa broken at a world it holds no rank in" in refusals[0]
    assert "pod mw-leader-0 reported world wb broken at epoch 7, which that world has not reached" in refusals[1]
    _, reports = inbox.current(table, set())
    assert [(r.world, r.epoch) for r in reports] == [("wa", 2)]
    # The world moved on: the report is history.
    _, reports = inbox.current(WorldTable(worlds=[entry("wa", 3), entry("wb", 1)]), set())
    assert reports == []
    # Before the operator knows the table (just started), a report waits for it: the latest per
    # pod and world, however many a worker sends.
    early = WorkerInbox()
    for epoch in range(1, 10_001):
        assert early.report("mw-leader-0", broken("wa", epoch), None)
    assert early.report("mw-leader-0", broken("wa", 2), None)
    assert early.report("mw-wa-0", broken("wa", 2), None)
    assert early.report("mw-wa-0", broken("wa", 5), None)  # its latest: one wa has not reached
    _, reports = early.current(table, set())
    assert [(r.world, r.epoch) for r in reports] == [("wa", 2)]
    assert [r.split(" broken")[0] for r in early.take_refusals()] == ["pod mw-wa-0 reported world wa"]


def test_a_report_names_the_rank_whose_address_its_failed_op_gives() -> None:
    """gloo's error gives the peer's address: the rank of the one pod with that IP is named the
    culprit (a warm spare by its own IP); an address of none, of the reporter itself or of two
    pods (the host's network) names nobody, and a report that names a rank keeps it."""
    cache = PodCache(OWNER)
    ips = {"mw-leader-0": "10.0.0.1", "mw-wa-0": "10.0.0.2", "mw-wa-spare-a": "10.0.0.3",
           "mw-wb-0": "10.0.0.9", "mw-wb-1": "10.0.0.9"}  # fmt: skip
    cache.listed([{**pod(name), "status": {"phase": "Running", "podIP": ip}} for name, ip in ips.items()], "1")
    addresses = pod_addresses(cache.pods())
    assert addresses == {"10.0.0.1": "mw-leader-0", "10.0.0.2": "mw-wa-0", "10.0.0.3": "mw-wa-spare-a"}
    table = WorldTable(worlds=[
        WorldEntry(name="wa", epoch=1, host="h", port=4000, pods=["mw-leader-0", "mw-wa-0", "mw-wa-spare-a"],
                   plays={"mw-wa-spare-a": "mw-wa-1"}),
        WorldEntry(name="wb", epoch=1, host="h", port=4001, pods=["mw-leader-0", "mw-wb-0", "mw-wb-1"]),
    ])  # fmt: skip

    def named(reporter: str, world: str, reason: str, peer_rank: int | None = None) -> int | None:
        inbox = WorkerInbox()
        assert inbox.report(
            reporter, BrokenWorldReport(world=world, epoch=1, reason=reason, peer_rank=peer_rank), table
        )
        _, (report,) = inbox.current(table, set(), addresses)
        return report.peer_rank

    assert named("mw-leader-0", "wa", "all_gather failed: Connection closed by peer [10.0.0.3]:18818.") == 2
    assert named("mw-wa-spare-a", "wa", "Read error [10.0.0.2]:5506: Connection reset by peer") == 1
    assert named("mw-leader-0", "wa", "recv timed out") is None
    assert named("mw-leader-0", "wa", "closed by peer [10.0.0.7]:1") is None  # no pod of ours
    assert named("mw-wa-0", "wa", "closed by peer [10.0.0.2]:1") is None  # the reporter's own
    assert named("mw-leader-0", "wb", "closed by peer [10.0.0.9]:1") is None  # two pods share it
    assert named("mw-leader-0", "wa", "closed by peer [10.0.0.3]:1 and [10.0.0.2]:2") is None  # two ranks
    assert named("mw-leader-0", "wa", "closed by peer [10.0.0.3]:1", peer_rank=1) == 1


def test_pod_cache_keeps_the_newest_of_listing_and_events() -> None:
    def at(name: str, version: int, phase: str = "Running") -> dict[str, Any]:
        return pod(name, phase, resourceVersion=str(version))

    cache = PodCache(OWNER)
    assert cache.stale()
    cache.changed(False, at("mw-a-0", 5, "Pending"))  # an event before the first listing
    cache.changed(True, at("mw-a-1", 12))  # deleted after the listing below was made
    cache.changed(False, at("mw-b-0", 15))  # created after it
    cache.listed([at("mw-a-0", 8), at("mw-a-1", 9), at("mw-b-1", 7)], "10")
    assert not cache.stale()
    phases = {p.name: p.observation.phase for p in cache.pods() if p.observation}
    assert phases == {"mw-a-0": "Running", "mw-b-0": "Running", "mw-b-1": "Running"}

    assert not cache.changed(False, at("mw-a-0", 6, "Failed"))  # older than what is known
    assert cache.changed(False, at("mw-a-0", 20, "Failed"))
    assert not cache.changed(False, at("mw-a-1", 11))  # a stale event of the deleted instance
    assert cache.changed(False, at("mw-a-1", 21, "Pending"))  # a new instance of that name
    assert cache.changed(True, at("mw-b-1", 7))  # a delete's response: the version it deleted
    cache.listed([at("mw-a-0", 20, "Failed"), at("mw-a-1", 21, "Pending"), at("mw-b-0", 15), at("mw-b-1", 7)], "19")
    phases = {p.name: p.observation.phase for p in cache.pods() if p.observation}
    assert phases == {"mw-a-0": "Failed", "mw-a-1": "Pending", "mw-b-0": "Running"}  # mw-b-1 stays deleted


def test_a_pod_counts_as_started_when_the_operator_first_saw_it_running() -> None:
    """By the operator's clock, the one worker reports are stamped with on arrival: a kubelet on
    another node, its clock skewed, has no say."""
    skewed = {"containerStatuses": [{"state": {"running": {"startedAt": "2099-01-01T00:00:00Z"}}}]}

    def at(version: int, phase: str = "Running", uid: str = "uid-1") -> dict[str, Any]:
        item = pod("mw-a-0", phase, resourceVersion=str(version), uid=uid)
        item["status"].update(skewed)
        return item

    def started() -> datetime | None:
        (seen,) = cache.pods()
        assert seen.observation is not None
        return seen.observation.started

    cache = PodCache(OWNER)
    cache.changed(False, at(1, "Pending"))
    assert started() is None
    before = datetime.now(UTC)
    cache.changed(False, at(2))
    first = started()
    assert first is not None and before <= first <= datetime.now(UTC)
    cache.changed(False, at(3))
    assert started() == first  # the first sighting, not the latest
    cache.changed(False, at(4, uid="uid-2"))  # a new instance of that name
    second = started()
    assert second is not None and second >= first


def test_the_memory_round_trips_through_its_configmap() -> None:
    memory = {
        "phase": "Running",
        "worlds": {f"w{i}": {"epoch": 1, "pods": ["mw-leader-0", f"mw-m{i}-0"]} for i in range(1000)},
    }
    body = memory_body({"metadata": {"name": "mw", "namespace": "ns", "uid": OWNER}}, memory)
    assert body["metadata"]["name"] == "mw" and body["metadata"]["ownerReferences"][0]["uid"] == OWNER
    assert read_memory(body) == memory
    assert len(body["binaryData"][MEMORY_KEY]) < len(json.dumps(memory)) / 4  # names repeat: it packs well
    assert memory_body({"metadata": {"name": "mw", "uid": OWNER}}, memory) == body  # the same bytes each time
    assert read_memory({"metadata": {"name": "mw"}}) is None


def test_pod_body_env_wins_over_the_template() -> None:
    template: dict[str, Any] = {
        "spec": {
            "containers": [{"name": "c", "env": [{"name": "MULTIWORLD_POD", "value": "x"}]}],
            "restartPolicy": "Always",
        }
    }
    multiworld = {"metadata": {"name": "mw", "namespace": "ns", "uid": OWNER}}
    action = CreatePod(pod="mw-a-0", member="a", ordinal=0, created_for={"wa": 3}, worlds=[], template=template)
    body = pod_body(action, multiworld, "operator://operator.ns.svc:7443")
    env = {e["name"]: e["value"] for e in body["spec"]["containers"][0]["env"]}
    assert env["MULTIWORLD_POD"] == "mw-a-0" and env["MULTIWORLD_TABLE"] == "operator://operator.ns.svc:7443"
    assert body["spec"]["restartPolicy"] == "Never"
    assert json.loads(body["metadata"]["annotations"][CREATED_FOR_ANNOTATION]) == {"wa": 3}
    assert template["spec"]["containers"][0]["env"] == [{"name": "MULTIWORLD_POD", "value": "x"}]  # not mutated


def test_a_pod_answers_the_name_of_its_mapped_loopback_from_its_hosts_file() -> None:
    """Every pod's /etc/hosts lists ::ffff:127.0.0.1 (what torch's store clients look up as rank
    0 connects to its own stores), after the template's own aliases; a pod on the node's
    network keeps the node's file."""
    own = {"ip": "10.0.0.9", "hostnames": ["registry.local"]}
    loopback = {"ip": "::ffff:127.0.0.1", "hostnames": ["localhost"]}
    multiworld = {"metadata": {"name": "mw", "namespace": "ns", "uid": OWNER}}
    for spec, expected in (
        ({"containers": [{"name": "c"}]}, [loopback]),
        ({"containers": [{"name": "c"}], "hostAliases": [own]}, [own, loopback]),
        ({"containers": [{"name": "c"}], "hostNetwork": True}, None),
    ):
        action = CreatePod(pod="mw-a-0", member="a", ordinal=0, created_for={}, worlds=[], template={"spec": spec})
        body = pod_body(action, multiworld, "operator://operator.ns.svc:7443")
        assert body["spec"].get("hostAliases") == expected, spec


def test_refusal_is_written_once_per_generation() -> None:
    first = refusal_patch(None, 1, ["spec.worlds[0].ranks[1]: member 'x' is not declared"], NOW)
    assert first is not None and first["phase"] == "Failed"
    assert refusal_patch(first, 1, ["spec.worlds[0].ranks[1]: member 'x' is not declared"], NOW) is None
    assert refusal_patch(first, 2, ["spec.worlds[0].ranks[1]: member 'x' is not declared"], NOW) is not None

    running = table_of(star(["wa"]), {"wa": 20000}).to_dict()
    edit = refusal_patch(running, 2, ["spec.members[0].name: bad"], NOW)
    assert edit is not None and set(edit) == {"observedGeneration", "conditions"}  # the worlds stay as they are
    assert [c["type"] for c in edit["conditions"]] == ["Ready", "Degraded", "SpecValid"]


def test_a_warm_spare_rather_goes_off_the_nodes_of_the_pods_it_stands_in_for() -> None:
    """A spare prefers a node without its member's pods (a lost node takes them, not it), then
    one without its member's other idle spares; the template's own anti-affinity is kept, and a
    member pod gets none of it."""
    multiworld = {"metadata": {"name": "mw", "namespace": "ns", "uid": OWNER}}
    own = {"weight": 7, "podAffinityTerm": {"labelSelector": {}, "topologyKey": "zone"}}
    template: dict[str, Any] = {
        "spec": {"containers": [{"name": "c"}], "affinity": {"podAntiAffinity": {PREFERRED: [own]}}}
    }
    spare = CreatePod(
        pod="mw-a-spare-x", member="a", ordinal=0, created_for={}, worlds=[], template=template, spare=True
    )
    terms = pod_body(spare, multiworld, "operator://o:1")["spec"]["affinity"]["podAntiAffinity"][PREFERRED]
    ours = {"multiworld.io/name": "mw", "multiworld.io/member": "a"}
    assert terms == [
        own,
        {
            "weight": 100,
            "podAffinityTerm": {
                "labelSelector": {
                    "matchLabels": ours,
                    "matchExpressions": [{"key": "multiworld.io/ordinal", "operator": "Exists"}],
                },
                "topologyKey": "kubernetes.io/hostname",
            },
        },
        {
            "weight": 50,
            "podAffinityTerm": {
                "labelSelector": {
                    "matchLabels": {**ours, "multiworld.io/spare": "true"},
                    "matchExpressions": [{"key": "multiworld.io/plays", "operator": "DoesNotExist"}],
                },
                "topologyKey": "kubernetes.io/hostname",
            },
        },
    ]
    member = CreatePod(pod="mw-a-0", member="a", ordinal=0, created_for={}, worlds=[], template=template)
    assert pod_body(member, multiworld, "operator://o:1")["spec"]["affinity"]["podAntiAffinity"][PREFERRED] == [own]
