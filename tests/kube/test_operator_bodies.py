"""The Kubernetes platform's pure parts, no API server: world ports, what a pod listing means
to the planner, the pod cache, the world table's ConfigMaps, the memory's ConfigMap, and the
status of an invalid spec."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from hypothesis import given, strategies as st
from operator_support import manifest

from multiworld.contract import (
    NAME_LABEL,
    REPORT_ANNOTATION,
    REPORTS_ANNOTATION,
    STATUS_ANNOTATION,
    TABLE_ENTRY_KEY,
    WORLD_LABEL,
    BrokenWorldReport,
    WorkerStatus,
    WorldEntry,
    WorldTable,
)
from multiworld_operator.kube.bodies import CREATED_FOR_ANNOTATION, pod_body
from multiworld_operator.kube.observe import observe_pods
from multiworld_operator.kube.planner_memory import MEMORY_KEY, memory_body, read_memory
from multiworld_operator.kube.pod_cache import PodCache
from multiworld_operator.kube.ports import PORT_BASE, PORT_SPAN, preferred_port, world_ports
from multiworld_operator.kube.refusal import refusal_patch
from multiworld_operator.kube.world_tables import published_entry, table_writes, world_table_body
from multiworld_operator.planner import CreatePod, MultiWorldStatus, Observation, plan
from multiworld_operator.spec import MultiWorld, parse_manifest

OWNER = "uid-of-mw"
NOW = datetime(2030, 1, 1, tzinfo=UTC)


def star(worlds: list[str]) -> MultiWorld:
    """Every world's rank 0 is the same leader pod."""
    members = {"leader": 1, **{f"m-{w}": 1 for w in worlds}}
    return parse_manifest(manifest("mw", members, {w: ["leader", f"m-{w}"] for w in worlds}))


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
    previous = table_of(multiworld, {"alpha": preferred_port("beta"), "beta": preferred_port("beta")}).table
    # beta's own spot is held by alpha (kept from the previous table): beta moves one up.
    ports = world_ports(multiworld, previous.model_copy(update={"worlds": previous.worlds[:1]}))
    assert ports == {
        "alpha": preferred_port("beta"),
        "beta": PORT_BASE + (preferred_port("beta") - PORT_BASE + 1) % PORT_SPAN,
    }


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
    older = report.model_copy(update={"world": "wb"})
    annotations = {
        CREATED_FOR_ANNOTATION: json.dumps({"wa": 1}),
        STATUS_ANNOTATION: WorkerStatus(pod="mw-a-1", joined={"wa": 1}).model_dump_json(),
        REPORTS_ANNOTATION: json.dumps([older.model_dump(mode="json"), report.model_dump(mode="json")]),
        REPORT_ANNOTATION: report.model_dump_json(),
    }
    cache = PodCache(OWNER)
    cache.listed(
        [
            pod("mw-a-1", annotations=annotations),
            pod("mw-a-0", "Unknown", annotations={CREATED_FOR_ANNOTATION: "not json", STATUS_ANNOTATION: "{}"}),
            pod("mw-b-0", deletionTimestamp="2030-01-01T00:00:00Z"),
            pod("mw-b-1", owner="uid-of-an-older-mw"),
        ],
        "100",
    )
    seen = observe_pods(cache.pods())

    by_name = {p.name: p for p in seen.pods}
    assert set(by_name) == {"mw-a-1", "mw-a-0"}  # terminating and foreign pods are not ours now
    assert (by_name["mw-a-1"].member, by_name["mw-a-1"].ordinal, by_name["mw-a-1"].phase) == ("a", 1, "Running")
    assert by_name["mw-a-1"].created_for == {"wa": 1} and by_name["mw-a-1"].joined == {"wa": 1}
    assert by_name["mw-a-0"].phase == "Pending"
    assert by_name["mw-a-0"].created_for == {} and by_name["mw-a-0"].joined is None  # unreadable: ignored
    assert seen.reports == [older, report]  # the single latest one is already in the list
    assert seen.present == {n: f"uid-{n}" for n in ("mw-a-1", "mw-a-0", "mw-b-0", "mw-b-1")}
    assert seen.terminating == {"mw-b-0"}


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


def test_table_writes_touch_only_the_worlds_that_changed() -> None:
    def entry(name: str, epoch: int) -> WorldEntry:
        return WorldEntry(
            name=name, epoch=epoch, host="mw-leader-0.mw", port=4000, pods=["mw-leader-0", f"mw-{name}-0"]
        )

    published: dict[str, WorldEntry | None] = {"wa": entry("wa", 1), "wb": entry("wb", 1), "wc": None}
    writes = table_writes(published, WorldTable(revision=2, worlds=[entry("wa", 1), entry("wb", 2), entry("wc", 1)]))
    assert [e.name for e in writes.write] == ["wb", "wc"] and writes.remove == []
    assert table_writes(published, WorldTable(revision=3, worlds=[entry("wb", 1)])).remove == ["wa", "wc"]

    body = world_table_body({"metadata": {"name": "mw", "namespace": "ns", "uid": OWNER}}, entry("wb", 2))
    assert body["metadata"]["name"] == "mw.wb"
    assert body["metadata"]["labels"] == {
        NAME_LABEL: "mw",
        WORLD_LABEL: "wb",
        "pod.multiworld.io/mw-leader-0": "0",
        "pod.multiworld.io/mw-wb-0": "1",
    }
    assert body["metadata"]["ownerReferences"][0]["uid"] == OWNER
    assert published_entry(body) == entry("wb", 2)
    assert published_entry({"data": {TABLE_ENTRY_KEY: "not json"}}) is None


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
    body = pod_body(action, multiworld)
    env = {e["name"]: e["value"] for e in body["spec"]["containers"][0]["env"]}
    assert env["MULTIWORLD_POD"] == "mw-a-0" and env["MULTIWORLD_TABLE"] == "kubernetes://ns/mw"
    assert body["spec"]["restartPolicy"] == "Never"
    assert json.loads(body["metadata"]["annotations"][CREATED_FOR_ANNOTATION]) == {"wa": 3}
    assert template["spec"]["containers"][0]["env"] == [{"name": "MULTIWORLD_POD", "value": "x"}]  # not mutated


def test_refusal_is_written_once_per_generation() -> None:
    first = refusal_patch(None, 1, ["spec.worlds[0].ranks[1]: member 'x' is not declared"], NOW)
    assert first is not None and first["phase"] == "Failed"
    assert refusal_patch(first, 1, ["spec.worlds[0].ranks[1]: member 'x' is not declared"], NOW) is None
    assert refusal_patch(first, 2, ["spec.worlds[0].ranks[1]: member 'x' is not declared"], NOW) is not None

    running = table_of(star(["wa"]), {"wa": 20000}).to_dict()
    edit = refusal_patch(running, 2, ["spec.members[0].name: bad"], NOW)
    assert edit is not None and set(edit) == {"observedGeneration", "conditions"}  # the worlds stay as they are
    assert [c["type"] for c in edit["conditions"]] == ["Ready", "Degraded", "SpecValid"]
