"""The MultiWorld models: loading, defaults, helpers, and refusals that name their field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from multiworld_operator.spec import SpecError, load_manifest, parse_duration, parse_manifest, spare_name
from multiworld_operator.spec.models import gpus_per_pod

pytestmark = pytest.mark.quick

GPU_TEMPLATE = {"spec": {"containers": [{"name": "w", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
CPU_TEMPLATE = {"spec": {"containers": [{"name": "w", "image": "x", "command": ["python", "main.py"]}]}}


def manifest(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "template": CPU_TEMPLATE,
        "members": [{"name": "leader"}, {"name": "w1", "replicas": 2}, {"name": "w2"}],
        "worlds": [
            {"name": "world1", "ranks": ["leader", "w1"]},
            {"name": "world2", "ranks": ["leader", "w2"]},
        ],
    }
    body.update(spec)
    return {"apiVersion": "multiworld.io/v1alpha1", "kind": "MultiWorld", "metadata": {"name": "demo"}, "spec": body}


def problems_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_manifest(data)
    return caught.value.problems


def test_defaults_and_pod_naming() -> None:
    mw = parse_manifest(manifest())
    assert mw.spec.backend == "auto"
    assert mw.member("leader").replicas == 1
    policy = mw.world("world1").failure_policy
    assert (policy.max_restarts, policy.window, policy.window_seconds) == (10, "1h", 3600.0)
    assert mw.pods_of("w1") == ["demo-w1-0", "demo-w1-1"]
    assert mw.world_pods("world1") == ["demo-leader-0", "demo-w1-0", "demo-w1-1"]
    assert mw.all_pods() == ["demo-leader-0", "demo-w1-0", "demo-w1-1", "demo-w2-0"]
    assert mw.shared_members() == ["leader"]
    assert mw.worlds_of_pod("demo-leader-0") == ["world1", "world2"]
    assert mw.worlds_of_pod("demo-w2-0") == ["world2"]
    assert mw.member_of_pod("demo-w1-1") == ("w1", 1)


def test_load_from_path_text_and_str_path(tmp_path: Path) -> None:
    text = yaml.safe_dump(manifest())
    path = tmp_path / "mw.yaml"
    path.write_text(text)
    assert load_manifest(path) == load_manifest(str(path)) == load_manifest(text)


def test_missing_file_and_bad_yaml_are_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_manifest(str(tmp_path / "absent.yaml"))
    with pytest.raises(SpecError, match="not valid YAML"):
        load_manifest("spec: [unclosed\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_manifest("- a\n- b\n")


def test_member_template_replaces_the_default() -> None:
    data = manifest()
    data["spec"]["members"][2]["template"] = GPU_TEMPLATE
    mw = parse_manifest(data)
    assert mw.template_of("w2") == GPU_TEMPLATE
    assert mw.template_of("leader") == CPU_TEMPLATE


def test_every_problem_is_listed_at_once_with_its_path() -> None:
    data = manifest(
        members=[{"name": "leader"}, {"name": "w1", "replicas": -1}, {"name": "w1"}, {"name": "lonely"}],
        worlds=[
            {"name": "world1", "ranks": ["leader", "w3", "leader"], "failurePolicy": {"window": "1x"}},
            {"name": "world1", "ranks": ["leader"]},
        ],
    )
    data["apiVersion"] = "multiworld.io/v1"
    problems = problems_of(data)
    expected = [
        "apiVersion:",
        "spec.members[1].replicas: Input should be greater than or equal to 1",
        "spec.worlds[0].failurePolicy.window: '1x' is not a duration",
        "spec.members[2].name: member 'w1' is declared twice",
        "spec.worlds[0].ranks[1]: member 'w3' is not declared",
        "spec.worlds[0].ranks[2]: member 'leader' appears twice in world 'world1'",
        "spec.worlds[1].name: world 'world1' is declared twice",
        "spec.worlds[1].ranks: world 'world1' has 1 rank(s)",
        "spec.members[1]: member 'w1' is in no world",
        "spec.members[3]: member 'lonely' is in no world",
    ]
    for start in expected:
        assert sum(p.startswith(start) for p in problems) == 1, (start, problems)
    assert len(problems) == len(expected)
    with pytest.raises(SpecError, match=r"10 problem\(s\)"):
        parse_manifest(data)


@pytest.mark.parametrize(
    ("edit", "path", "fragment"),
    [
        (lambda d: d.update(kind="Job"), "kind", "MultiWorld"),
        (lambda d: d["metadata"].update(name="Demo"), "metadata.name", "not a valid name"),
        (lambda d: d["metadata"].update(name="1demo"), "metadata.name", "starting with a letter"),
        (lambda d: d["metadata"].pop("name"), "metadata.name", "required"),
        (lambda d: d["spec"]["members"][0].update(name="Leader_"), "spec.members[0].name", "not a valid name"),
        (lambda d: d["spec"]["worlds"][1].update(name="w" * 64), "spec.worlds[1].name", "not a valid name"),
        (lambda d: d["spec"].update(backend="mpi"), "spec.backend", "auto"),
        (lambda d: d["spec"]["worlds"][0].update(backend="ucc"), "spec.worlds[0].backend", "nccl"),
        (
            lambda d: d["spec"]["worlds"][0].update(failurePolicy={"maxRestarts": -1}),
            "spec.worlds[0].failurePolicy.maxRestarts",
            "greater than or equal to 0",
        ),
        (
            lambda d: d["spec"]["worlds"][0].update(failurePolicy={"backoff": {"maxDelay": "soon"}}),
            "spec.worlds[0].failurePolicy.backoff.maxDelay",
            "not a duration",
        ),
        (lambda d: d["spec"]["worlds"][0].update(rnaks=["leader"]), "spec.worlds[0].rnaks", "Extra inputs"),
        (lambda d: d["spec"].update(worlds=[]), "spec.worlds", "at least 1"),
        (lambda d: d["spec"]["members"][1].update(replicas="two"), "spec.members[1].replicas", "integer"),
    ],
)
def test_refusals_name_the_field(edit: Any, path: str, fragment: str) -> None:
    data = copy.deepcopy(manifest())
    edit(data)
    problems = problems_of(data)
    assert any(p.startswith(f"{path}:") and fragment in p for p in problems), problems


def test_pod_name_limit_counts_the_highest_ordinal() -> None:
    data = manifest(members=[{"name": "a"}, {"name": "b"}], worlds=[{"name": "pair", "ranks": ["a", "b"]}])
    data["metadata"]["name"] = "m" * 58
    for replicas in (1, 10, 100):  # longest pod name 62, 62, 63 characters: fits
        data["spec"]["members"][0]["replicas"] = replicas
        parse_manifest(data)
    data["spec"]["members"][0]["replicas"] = 1000  # m...m-a-999 is 64 characters
    assert problems_of(data) == [
        f"spec.members[0].name: pod name '{'m' * 58}-a-999' is 64 characters; <name>-<member>-<ordinal> must fit in 63"
    ]


def test_spare_names_must_fit_a_label_and_spares_have_a_maximum() -> None:
    data = manifest(members=[{"name": "a", "spares": 2}, {"name": "b"}], worlds=[{"name": "pair", "ranks": ["a", "b"]}])
    data["metadata"]["name"] = "m" * 50  # m...m-a-spare-aaaa is 63 characters: fits
    parse_manifest(data)
    data["metadata"]["name"] = "m" * 51
    assert problems_of(data) == [
        f"spec.members[0].spares: spare pod names '{'m' * 51}-a-spare-aaaa' would be 64 characters; "
        "<name>-<member>-spare-<serial> must fit in 63 (a shorter member or MultiWorld name)"
    ]
    data["spec"]["members"][0]["spares"] = 0  # no spares, no spare names
    parse_manifest(data)
    data["metadata"]["name"] = "demo"
    data["spec"]["members"][0]["spares"] = 65
    assert problems_of(data) == ["spec.members[0].spares: Input should be less than or equal to 64"]


def test_spare_names_end_in_letters_and_never_repeat() -> None:
    names = [spare_name("mw", "w1", serial) for serial in range(26 * 27 + 1)]
    assert names[:3] == ["mw-w1-spare-a", "mw-w1-spare-b", "mw-w1-spare-c"]
    assert names[25:28] == ["mw-w1-spare-z", "mw-w1-spare-aa", "mw-w1-spare-ab"]
    assert len(set(names)) == len(names) and all(n[-1].isalpha() for n in names)


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        (
            ("failurePolicy", "window"),
            "10000000d",
            "failurePolicy.window: '10000000d' is longer than the maximum duration, 366d",
        ),
        (
            ("failurePolicy", "backoff", "initialDelay"),
            "367d",
            "initialDelay: '367d' is longer than the maximum duration, 366d",
        ),
        (("failurePolicy", "backoff", "factor"), 1e40, "factor: Input should be less than or equal to 100"),
        (("failurePolicy", "maxRestarts"), 10**9, "maxRestarts: Input should be less than or equal to 10000"),
    ],
)
def test_every_number_and_duration_has_a_maximum(path: tuple[str, ...], value: object, problem: str) -> None:
    data = manifest(members=[{"name": "a", "replicas": 2}], worlds=[{"name": "w", "ranks": ["a"]}])
    target = data["spec"]["worlds"][0]
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    (found,) = problems_of(data)
    assert found.startswith("spec.worlds[0].") and found.endswith(problem), found


def test_replicas_count_towards_world_size() -> None:
    data = manifest(members=[{"name": "solo", "replicas": 2}], worlds=[{"name": "pair", "ranks": ["solo"]}])
    mw = parse_manifest(data)
    assert mw.world_pods("pair") == ["demo-solo-0", "demo-solo-1"]
    data["spec"]["members"][0]["replicas"] = 1
    assert problems_of(data) == [
        "spec.worlds[0].ranks: world 'pair' has 1 rank(s) after expanding replicas; a world needs at least 2"
    ]


def test_status_of_a_manifest_read_from_the_cluster_is_ignored() -> None:
    data = manifest()
    data["status"] = {"phase": "Running"}
    data["metadata"].update(generation=3, resourceVersion="12", uid="abc")
    mw = parse_manifest(data)
    assert mw.metadata.generation == 3
    assert "status" not in mw.model_dump(by_alias=True)


def test_model_validate_runs_the_same_cross_field_checks() -> None:
    from pydantic import ValidationError

    from multiworld_operator.spec import MultiWorld

    data = manifest(worlds=[{"name": "world1", "ranks": ["leader", "ghost"]}])
    with pytest.raises(ValidationError, match="member 'ghost' is not declared"):
        MultiWorld.model_validate(data)


# -- backends ---------------------------------------------------------------------------------


def test_auto_backend_is_nccl_only_when_every_rank_requests_gpus() -> None:
    data = manifest(template=GPU_TEMPLATE)
    data["spec"]["members"][2]["template"] = CPU_TEMPLATE
    mw = parse_manifest(data)
    assert mw.backend_of("world1") == "nccl"
    assert mw.backend_of("world2") == "gloo"  # w2 has no GPU


def test_gpu_requests_may_be_strings_or_requests() -> None:
    template = {
        "spec": {
            "containers": [
                {"name": "a", "image": "x"},
                {"name": "b", "image": "x", "resources": {"requests": {"nvidia.com/gpu": "2"}}},
            ]
        }
    }
    mw = parse_manifest(manifest(template=template))
    assert mw.backend_of("world1") == "nccl"
    zero = {"spec": {"containers": [{"name": "a", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 0}}}]}}
    assert parse_manifest(manifest(template=zero)).backend_of("world1") == "gloo"


def test_gpus_per_pod_adds_up_its_containers_and_takes_limits_or_requests() -> None:
    def container(resources: dict[str, Any]) -> dict[str, Any]:
        return {"name": "c", "image": "x", "resources": resources}

    both = [container({"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": "2"}})]
    assert gpus_per_pod({"spec": {"containers": both + [container({"requests": {"nvidia.com/gpu": "3"}})]}}) == 5
    assert gpus_per_pod({"spec": {"containers": [container({"limits": {"cpu": "1"}})]}}) == 0
    assert gpus_per_pod({"spec": {"containers": [container({"limits": {"nvidia.com/gpu": "one"}})]}}) == 0
    assert gpus_per_pod({"spec": {"containers": [container({"limits": {"nvidia.com/gpu": 1.0}})]}}) == 1
    assert gpus_per_pod({"spec": {}}) == 0


def test_explicit_backends_override_the_default() -> None:
    data = manifest(backend="nccl")
    data["spec"]["worlds"][1]["backend"] = "gloo"
    mw = parse_manifest(data)
    assert (mw.backend_of("world1"), mw.backend_of("world2")) == ("nccl", "gloo")


def test_local_backend_rules() -> None:
    data = manifest()
    data["spec"]["worlds"][1]["backend"] = "nccl"
    mw = parse_manifest(data)
    assert mw.local_backend_of("world1", cuda_available=True) == ("nccl", None)
    assert mw.local_backend_of("world1", cuda_available=False) == ("gloo", None)
    assert mw.local_backend_of("world2", cuda_available=True) == ("nccl", None)
    backend, warning = mw.local_backend_of("world2", cuda_available=False)
    assert backend == "gloo" and warning is not None and "world2" in warning and "nccl" in warning


# -- durations --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("5m", 300), ("1h", 3600), ("1h30m", 5400), ("500ms", 0.5), ("2d", 172800), ("0s", 0), ("1.5m", 90)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "1", "h", "1x", "-5s", "1 h", " 1h", "1h-"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_backoff_delays() -> None:
    from multiworld_operator.spec import Backoff

    backoff = Backoff(initial_delay="2s", max_delay="10s", factor=2)
    assert [backoff.delay(k) for k in range(6)] == [0, 2, 4, 8, 10, 10]


def test_a_declared_port_among_the_store_ports_is_refused_naming_the_field() -> None:
    """The NetworkPolicy opens declared ports to everyone; the worlds' stores must stay open to
    the MultiWorld's own pods only."""
    ports = [{"containerPort": 8080}, {"containerPort": 20001}]
    template = {"spec": {"containers": [{"name": "w", "image": "x", "ports": ports}]}}
    data = manifest(template=template)
    data["spec"]["members"][1]["template"] = {
        "spec": {"containers": [{"name": "w", "image": "x", "ports": [{"containerPort": 29999}]}]}
    }
    found = problems_of(data)
    store = "spec.template.spec.containers[0].ports[1].containerPort: 20001 is in 20000-29999"
    assert any(p.startswith(store) for p in found), found
    member = "spec.members[1].template.spec.containers[0].ports[0].containerPort: 29999"
    assert any(p.startswith(member) for p in found), found
    assert not any("8080" in p for p in found), found
