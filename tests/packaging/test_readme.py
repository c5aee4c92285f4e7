"""The README off this machine: its MultiWorld snippet declares every member its worlds rank, and
every example names the one worker image that the README's Kubernetes steps replace with yours."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
WORKER_IMAGE = f"ghcr.io/multiworld/worker:{VERSION}"


def test_the_readme_manifest_declares_every_member_its_worlds_rank() -> None:
    (snippet,) = [
        block for block in re.findall(r"```yaml\n(.*?)```", README, flags=re.DOTALL) if "kind: MultiWorld" in block
    ]
    spec = yaml.safe_load(snippet)["spec"]
    members = {member["name"] for member in spec["members"]}
    ranked = {name for world in spec["worlds"] for name in world["ranks"]}
    assert ranked <= members, f"ranks name undeclared members: {sorted(ranked - members)}"


def container_images(template: dict[str, Any] | None) -> list[str]:
    spec = (template or {}).get("spec", {})
    return [c["image"] for c in spec.get("containers", []) + spec.get("initContainers", [])]


def test_every_example_names_the_one_worker_image_the_readme_replaces() -> None:
    manifests = sorted((REPO / "examples").glob("*/multiworld*.yaml"))
    assert len(manifests) >= 10
    for path in manifests:
        spec = yaml.safe_load(path.read_text())["spec"]
        templates = [spec.get("template"), *(member.get("template") for member in spec["members"])]
        images = {image for template in templates for image in container_images(template)}
        assert images == {WORKER_IMAGE}, f"{path.relative_to(REPO)} names {sorted(images)}"
    replace = f'sed "s|{WORKER_IMAGE}|$REGISTRY/multiworld/worker:{VERSION}|"'
    assert replace in README, "the README's Kubernetes steps no longer replace the examples' image"
    assert "--set image.repository=$REGISTRY/multiworld/operator" in README
    for target in ("operator", "worker"):
        assert f"docker build --target {target} -t $REGISTRY/multiworld/{target}:{VERSION} ." in README
        assert f"docker push $REGISTRY/multiworld/{target}:{VERSION}" in README
