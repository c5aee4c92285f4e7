"""The MultiWorld CustomResourceDefinition, generated from the pydantic models.

Public API: `crd() -> dict` and `crd_yaml() -> str` (what `multiworld crd` prints, and what
crds/multiworld.io_multiworlds.yaml holds). The schema is structural (apiextensions.k8s.io/v1,
Kubernetes 1.20: no CEL): every node typed, pod templates kept whole with
x-kubernetes-preserve-unknown-fields, the spec's scalar defaults applied by the API server.
Cross-field rules (references, sizes, pod name length) and the caps a schema cannot say (pods
and ranks in all, worlds per pod, the spec's size: spec/cross_field.py) are checked by the controller.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from multiworld_operator.planner.status import StatusView
from multiworld_operator.spec import MultiWorldSpec
from multiworld_operator.spec.resource import API_GROUP, API_VERSION, KIND, PLURAL, SHORT_NAMES, SINGULAR

# JSON-schema keywords a structural schema keeps as they are.
_KEPT = (
    "description",
    "format",
    "pattern",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "x-kubernetes-map-type",
)


def crd() -> dict[str, Any]:
    status = _schema(StatusView, defaults=False, nullable=True)
    # Leaves room for fields written by other controllers (e.g. kopf's own bookkeeping).
    status["x-kubernetes-preserve-unknown-fields"] = True
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": SINGULAR,
                "kind": KIND,
                "listKind": f"{KIND}List",
                "shortNames": list(SHORT_NAMES),
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _printer_columns(),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "Independent torch.distributed worlds over shared pods; "
                            "a failure in one world leaves the others running.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": _schema(MultiWorldSpec, defaults=True, nullable=False),
                                "status": status,
                            },
                            "required": ["spec"],
                        }
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    return yaml.safe_dump(crd(), sort_keys=False)


def _printer_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {
            "name": "Worlds",
            "type": "string",
            "jsonPath": ".status.worldsReady",
            "description": "Running worlds / all worlds",
        },
        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
        {
            "name": "Updated",
            "type": "string",
            "jsonPath": ".status.updated",
            "description": "Member pods of their member's current template / all member pods",
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        # With -o wide: which worlds are unhealthy, and where a rollout stands.
        {
            "name": "Health",
            "type": "string",
            "priority": 1,
            "jsonPath": '.status.conditions[?(@.type=="Degraded")].message',
            "description": "The worlds failed or recovering (the Degraded condition's message)",
        },
        {
            "name": "Rollout",
            "type": "string",
            "priority": 1,
            "jsonPath": '.status.conditions[?(@.type=="Progressing")].reason',
            "description": "RollingOut, RolloutPaused, RolloutHalted or RolloutComplete (the Progressing condition)",
        },
    ]


def _schema(model: type[BaseModel], *, defaults: bool, nullable: bool) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True)
    return _Structural(schema.get("$defs", {}), defaults, nullable).convert(schema)


class _Structural:
    """Turns pydantic's JSON schema into a Kubernetes structural schema: $refs inlined,
    Optional as nullable, free-form objects preserved, titles and `additionalProperties:
    false` dropped (the API server prunes unknown fields instead)."""

    def __init__(self, defs: dict[str, Any], defaults: bool, nullable: bool) -> None:
        self.defs, self.defaults, self.nullable = defs, defaults, nullable

    def convert(self, node: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in node:
            target = self.convert(self.defs[node["$ref"].rsplit("/", 1)[-1]])
            return {**target, **self._kept(node)}
        if "anyOf" in node:
            return self._optional(node)
        out: dict[str, Any] = {"type": node["type"]} if "type" in node else {}
        out.update(self._kept(node))
        if "const" in node:
            out["type"], out["enum"] = "string", [node["const"]]
        if node.get("type") == "object":
            out.update(self._object(node))
        elif node.get("type") == "array":
            out["items"] = self.convert(node["items"])
        if self.defaults and "default" in node and not isinstance(node["default"], (dict, list)):
            out["default"] = node["default"]
        if "type" not in out:
            raise ValueError(f"no structural type for schema {node}")
        return out

    def _kept(self, node: dict[str, Any]) -> dict[str, Any]:
        kept = {k: node[k] for k in _KEPT if k in node}
        if "description" in kept:
            kept["description"] = " ".join(kept["description"].split())
        return kept

    def _optional(self, node: dict[str, Any]) -> dict[str, Any]:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"a union of several types has no structural schema: {node['anyOf']}")
        out = {**self.convert(options[0]), **self._kept(node)}
        if self.nullable:
            out["nullable"] = True
        return out

    def _object(self, node: dict[str, Any]) -> dict[str, Any]:
        if "properties" in node:
            out: dict[str, Any] = {"properties": {k: self.convert(v) for k, v in node["properties"].items()}}
            if node.get("required"):
                out["required"] = list(node["required"])
            return out
        values = node.get("additionalProperties")
        if isinstance(values, dict) and values:
            return {"additionalProperties": self.convert(values), **self._kept(node)}
        return {"x-kubernetes-preserve-unknown-fields": True}
