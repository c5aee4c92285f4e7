"""The caps of the spec (spec/limits.py) against the limits they follow from: the largest spec they
admit is accepted and everything written for it fits its limit, with names of 63 characters;
one past any cap is refused, naming its field. The figures come from the real code
(tests.support.limits_support: the planner, the operator's bodies, the worker's annotations). The time and
memory of planning it are a benchmark's targets (`bench/scale.py --largest`), not a test's."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import pytest

from multiworld_operator.crd import crd
from multiworld_operator.kube.memory.planner_memory import MAX_MEMORY_BYTES, MAX_MEMORY_VALUES
from multiworld_operator.spec import SpecError, parse_manifest
from multiworld_operator.spec.limits import (
    MAX_MEMBERS,
    MAX_PODS,
    MAX_PROBLEM_LENGTH,
    MAX_PROBLEMS,
    MAX_RANKS,
    MAX_REPLICAS,
    MAX_SPEC_BYTES,
    MAX_SPEC_DEPTH,
    MAX_WORLDS,
    MAX_WORLDS_PER_POD,
)
from tests.support.limits_support import (
    ANNOTATIONS_LIMIT,
    CONFIGMAP_LIMIT,
    ENV_STRING_LIMIT,
    MAX_LINE,
    STATUS_ROOM,
    Largest,
    annotations_bytes,
    env_string,
    exec_string_limit,
    largest_manifest,
    measure_largest,
    pod_annotations,
    worker_line,
)
from tests.support.tenant import nested

pytestmark = pytest.mark.quick

# Each figure at most this share of its limit: what the caps keep in hand.
MARGIN = 0.8


@pytest.fixture(scope="module")
def largest() -> Largest:
    return measure_largest()


@pytest.mark.slow
def test_the_largest_spec_is_accepted_and_reaches_every_cap(largest: Largest) -> None:
    assert (largest.pods, largest.ranks, largest.worlds, largest.worlds_per_pod) == (
        MAX_PODS,
        MAX_RANKS,
        MAX_WORLDS,
        MAX_WORLDS_PER_POD,
    )
    assert largest.spec_bytes <= MAX_SPEC_BYTES


def test_the_pod_in_most_worlds_can_start_be_annotated_and_speak() -> None:
    """Its environment string, its annotations and its worker's longest message at
    MAX_WORLDS_PER_POD worlds, every name and number at its longest, against the kernel's, the
    API server's and the worker channel's limits."""
    env = len(env_string(MAX_WORLDS_PER_POD))
    annotations = annotations_bytes(pod_annotations(MAX_WORLDS_PER_POD))
    assert env <= MARGIN * ENV_STRING_LIMIT, env
    assert annotations <= MARGIN * ANNOTATIONS_LIMIT, annotations
    assert worker_line(MAX_WORLDS_PER_POD) <= MARGIN * MAX_LINE
    # The environment grows with the worlds: the cap is what keeps it there.
    assert len(env_string(4 * MAX_WORLDS_PER_POD)) > ENV_STRING_LIMIT


@pytest.mark.skipif(sys.platform != "linux", reason="Linux's MAX_ARG_STRLEN")
def test_the_environment_string_limit_is_the_kernels() -> None:
    assert exec_string_limit() == ENV_STRING_LIMIT


@pytest.mark.slow
def test_what_the_operator_writes_for_the_largest_spec_fits(largest: Largest) -> None:
    # The MultiWorld: a spec as large as admitted, annotations as large as allowed, the status
    # at its largest.
    assert largest.status_worst_bytes <= MARGIN * STATUS_ROOM, largest
    assert largest.memory_configmap_data_bytes <= MARGIN * CONFIGMAP_LIMIT, largest
    # What the operator reads back of it (a tenant may write that ConfigMap: it reads no more).
    assert largest.memory_bytes <= MARGIN * MAX_MEMORY_BYTES, largest
    assert largest.memory_values <= MARGIN * MAX_MEMORY_VALUES, largest
    assert largest.env_string_bytes <= MARGIN * ENV_STRING_LIMIT, largest
    assert largest.annotations_bytes <= MARGIN * ANNOTATIONS_LIMIT, largest
    assert largest.worker_line_bytes <= MARGIN * MAX_LINE, largest


def _more_ranks(data: dict[str, Any]) -> None:
    data["spec"]["worlds"][1]["ranks"].append(data["spec"]["members"][-1]["name"])


def _more_pods(data: dict[str, Any]) -> None:
    next(m for m in data["spec"]["members"] if m.get("spares"))["spares"] += 1


def _more_worlds_per_pod(data: dict[str, Any]) -> None:
    worlds = data["spec"]["worlds"]
    worlds[MAX_WORLDS_PER_POD]["ranks"][0] = worlds[0]["ranks"][0]


def _more_worlds(data: dict[str, Any]) -> None:
    data["spec"]["worlds"].append({**data["spec"]["worlds"][0], "name": "one-more"})


def _larger_spec(data: dict[str, Any]) -> None:
    data["spec"]["template"]["metadata"] = {"annotations": {"big": "x" * MAX_SPEC_BYTES}}


@pytest.mark.parametrize(
    ("edit", "path", "fragment"),
    [
        (
            _more_ranks,
            "spec.worlds",
            f"{MAX_RANKS + 1} ranks in all worlds after expanding replicas; at most {MAX_RANKS}",
        ),
        (_more_pods, "spec.members", f"{MAX_PODS + 1} pods in all (replicas and spares of every member); at most"),
        (_more_worlds_per_pod, "spec.members[0]", f"{MAX_WORLDS_PER_POD + 1} worlds; a pod may be in at most"),
        (_larger_spec, "spec", f"bytes as JSON; at most {MAX_SPEC_BYTES}"),
    ],
)
def test_one_past_a_cap_is_refused_naming_its_field(
    edit: Callable[[dict[str, Any]], None], path: str, fragment: str
) -> None:
    data = largest_manifest()
    parse_manifest(copy.deepcopy(data))
    edit(data)
    with pytest.raises(SpecError) as caught:
        parse_manifest(data)
    (found,) = caught.value.problems
    assert found.startswith(f"{path}: ") and fragment in found, found


def test_the_schema_refuses_what_it_can_say() -> None:
    data = largest_manifest()
    _more_worlds(data)
    with pytest.raises(SpecError) as caught:
        parse_manifest(data)
    assert f"spec.worlds: List should have at most {MAX_WORLDS} items after validation, not {MAX_WORLDS + 1}" in (
        caught.value.problems
    )
    (version,) = crd()["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["worlds"]["maxItems"] == MAX_WORLDS and spec["members"]["maxItems"] == MAX_MEMBERS
    assert spec["members"]["items"]["properties"]["replicas"]["maximum"] == MAX_REPLICAS
    assert spec["worlds"]["items"]["properties"]["ranks"]["maxItems"] == MAX_MEMBERS


def test_a_refusal_lists_a_bounded_number_of_bounded_problems() -> None:
    data = largest_manifest()
    for world in data["spec"]["worlds"]:
        world["ranks"].append("y" * 10_000)  # an undeclared member in every world, its name too long
    with pytest.raises(SpecError) as caught:
        parse_manifest(data)
    problems, count = caught.value.problems, caught.value.count
    assert count > MAX_PROBLEMS and f"({count} problem(s))" in str(caught.value)
    assert len(problems) == MAX_PROBLEMS + 1 and problems[-1] == f"and {count - MAX_PROBLEMS} more problem(s)"
    assert all(len(p) <= MAX_PROBLEM_LENGTH for p in problems)


def test_a_spec_nested_past_its_cap_is_refused_naming_its_field_at_any_depth() -> None:
    """MAX_SPEC_DEPTH levels pass, one more is refused naming the field it is under; and a value
    as deep as the API server stores (10,000 levels) is judged at the default recursion limit,
    with nothing else run on it."""
    data = largest_manifest()
    # spec (1), template (2), junk (3): the list at depth 3 holds MAX_SPEC_DEPTH - 2 levels more.
    data["spec"]["template"]["junk"] = nested(MAX_SPEC_DEPTH - 2)
    parse_manifest(copy.deepcopy(data))
    data["spec"]["template"]["junk"] = nested(MAX_SPEC_DEPTH - 1)
    with pytest.raises(SpecError) as caught:
        parse_manifest(copy.deepcopy(data))
    (found,) = caught.value.problems
    assert found.startswith("spec.template.junk") and f"nested more than {MAX_SPEC_DEPTH} levels deep" in found
    data["spec"]["members"][0]["template"] = {"spec": {"x": nested(10_000)}}
    assert sys.getrecursionlimit() <= 1000
    with pytest.raises(SpecError) as caught:
        parse_manifest(data)
    assert [p.split(":")[0] for p in caught.value.problems] == [
        "spec.members[0].template.spec",
        "spec.template.junk[0][0]",
    ]
