"""What the chart tests share: where the chart is, the release they render, the rendered objects."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "multiworld-operator"
RELEASE = "mw"
RELEASE_NAMESPACE = "ops"
FULLNAME = "mw-multiworld-operator"

Manifest = dict[str, Any]


def example_pod_templates() -> list[tuple[str, Manifest]]:
    """(example folder, pod template) of spec.template and every member template of each example."""
    found = []
    for manifest in sorted((REPO / "examples").glob("*/multiworld.yaml")):
        spec = yaml.safe_load(manifest.read_text())["spec"]
        templates = [spec["template"]] + [m["template"] for m in spec["members"] if "template" in m]
        found += [(manifest.parent.name, template) for template in templates]
    return found


@dataclass(frozen=True)
class Rendered:
    """The objects a release would create, and its NOTES.txt."""

    objects: list[Manifest]
    notes: str

    def of_kind(self, kind: str) -> list[Manifest]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def one(self, kind: str, name: str, namespace: str | None = None) -> Manifest:
        found = [
            obj
            for obj in self.of_kind(kind)
            if obj["metadata"]["name"] == name and obj["metadata"].get("namespace") == namespace
        ]
        assert len(found) == 1, f"expected one {kind} {namespace}/{name}, found {len(found)}"
        return found[0]
