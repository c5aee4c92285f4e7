"""The CRD is generated from the models, is structural, and matches the committed file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from multiworld_operator.crd import crd, crd_yaml
from multiworld_operator.spec.limits import MAX_REPLICAS

pytestmark = pytest.mark.quick

COMMITTED = Path(__file__).resolve().parents[2] / "crds" / "multiworld.io_multiworlds.yaml"


def version() -> dict[str, Any]:
    (only,) = crd()["spec"]["versions"]
    return only


def schema() -> dict[str, Any]:
    return version()["schema"]["openAPIV3Schema"]


def test_committed_crd_is_the_generated_one() -> None:
    assert COMMITTED.read_text() == crd_yaml(), (
        "crds/multiworld.io_multiworlds.yaml is out of date; regenerate it with "
        "`multiworld crd > crds/multiworld.io_multiworlds.yaml` (or `make crd`)"
    )


def test_crd_yaml_round_trips() -> None:
    assert yaml.safe_load(crd_yaml()) == crd()


def test_names_scope_and_subresources() -> None:
    body = crd()
    assert body["apiVersion"] == "apiextensions.k8s.io/v1"
    assert body["metadata"]["name"] == "multiworlds.multiworld.io"
    spec = body["spec"]
    assert spec["group"] == "multiworld.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["plural"] == "multiworlds" and spec["names"]["kind"] == "MultiWorld"
    assert spec["names"]["shortNames"] == ["mw"]
    assert version()["name"] == "v1alpha1" and version()["served"] and version()["storage"]
    assert version()["subresources"] == {"status": {}}


def test_printer_columns() -> None:
    printed = version()["additionalPrinterColumns"]
    columns = {c["name"]: (c["type"], c["jsonPath"], c.get("priority", 0)) for c in printed}
    assert columns == {
        "Phase": ("string", ".status.phase", 0),
        "Worlds": ("string", ".status.worldsReady", 0),
        "Restarts": ("integer", ".status.restarts", 0),
        "Updated": ("string", ".status.updated", 0),
        "Age": ("date", ".metadata.creationTimestamp", 0),
        # -o wide only
        "Health": ("string", '.status.conditions[?(@.type=="Degraded")].message', 1),
        "Rollout": ("string", '.status.conditions[?(@.type=="Progressing")].reason', 1),
    }


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    nodes = [(path, node)]
    for key, child in node.get("properties", {}).items():
        nodes += _walk(child, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        nodes += _walk(node["additionalProperties"], f"{path}{{*}}")
    if "items" in node:
        nodes += _walk(node["items"], f"{path}[*]")
    return nodes


def test_schema_is_structural() -> None:
    # What a structural schema may hold (Kubernetes' rules), written out here, not taken from crd.py.
    allowed = set(
        "type description format pattern enum minimum maximum minLength maxLength minItems maxItems properties "
        "required items additionalProperties nullable default x-kubernetes-preserve-unknown-fields "
        "x-kubernetes-map-type".split()
    )
    for path, node in _walk(schema()):
        assert "type" in node, f"{path or '<root>'} has no type"
        assert set(node) <= allowed, f"{path}: {set(node) - allowed}"
        assert not ("properties" in node and "additionalProperties" in node), path
        if "required" in node:
            assert set(node["required"]) <= set(node["properties"]), path


def test_spec_fields_are_typed_and_templates_preserved() -> None:
    spec = schema()["properties"]["spec"]
    assert spec["required"] == ["members", "worlds"]
    assert spec["properties"]["backend"]["enum"] == ["auto", "nccl", "gloo"]
    assert spec["properties"]["backend"]["default"] == "auto"
    assert spec["properties"]["template"] == {
        "type": "object",
        "description": "The default PodTemplateSpec of every member.",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    member = spec["properties"]["members"]["items"]
    assert member["properties"]["replicas"] == {
        "type": "integer",
        "description": member["properties"]["replicas"]["description"],
        "minimum": 1,
        "maximum": MAX_REPLICAS,
        "default": 1,
    }
    assert member["properties"]["template"]["x-kubernetes-preserve-unknown-fields"] is True
    world = spec["properties"]["worlds"]["items"]
    assert world["required"] == ["name", "ranks"]
    assert world["properties"]["ranks"]["items"]["type"] == "string"
    policy = world["properties"]["failurePolicy"]["properties"]
    assert policy["maxRestarts"]["default"] == 10 and policy["maxRestarts"]["minimum"] == 0
    assert policy["window"]["default"] == "1h" and "pattern" in policy["window"]


def test_status_schema_holds_what_kubectl_reads_and_no_more() -> None:
    status = schema()["properties"]["status"]
    assert status["x-kubernetes-preserve-unknown-fields"] is True
    fields = status["properties"]
    assert set(fields) == {
        "phase",
        "observedGeneration",
        "worlds",
        "conditions",
        "worldsReady",
        "restarts",
        "playedBy",
        "spares",
        "updated",
        "rollout",
    }
    worlds = fields["worlds"]
    world = worlds["additionalProperties"]["properties"]
    assert set(world) == {
        "phase",
        "epoch",
        "size",
        "readyRanks",
        "restarts",
        "lastFailure",
        "restartAt",
        "waiting",
        "formedAt",
    }
    assert {"time", "reason", "pod", "rank"} <= set(world["lastFailure"]["properties"])
    # One entry in managedFields for every world together, not one per world and field.
    assert worlds["x-kubernetes-map-type"] == "atomic"
    # Lists are atomic too (no per-item managedFields); duplicate names are the controller's to refuse.
    spec = schema()["properties"]["spec"]["properties"]
    assert all("x-kubernetes-list-type" not in spec[field] for field in ("members", "worlds"))
    # The API server applies no defaults to status: the planner writes every field itself.
    assert all("default" not in node for _, node in _walk(status))


def test_names_and_durations_carry_patterns_the_models_also_enforce() -> None:
    import re

    world = schema()["properties"]["spec"]["properties"]["worlds"]["items"]["properties"]
    name = re.compile(world["name"]["pattern"])
    assert name.match("world-1") and not name.match("World_1")
    window = re.compile(world["failurePolicy"]["properties"]["window"]["pattern"])
    assert window.match("1h30m") and not window.match("1 hour")
