"""A manifest edit that a running local MultiWorld cannot take is refused naming each field."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from multiworld_operator.local.manifest_follower import layout_changes
from multiworld_operator.spec import MultiWorld, parse_manifest

pytestmark = pytest.mark.quick

# The seed topology: leader, w1 (2 replicas), w2 (2 replicas); world1 and world2.
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "all_gather" / "multiworld.yaml"


def example(edit: Callable[[dict[str, Any]], object] = lambda spec: None) -> MultiWorld:
    doc = yaml.safe_load(EXAMPLE.read_text())
    edit(doc["spec"])
    return parse_manifest(doc)


def test_a_kept_field_that_changed_is_named_with_both_values() -> None:
    current = example()
    more = example(lambda spec: spec["members"][1].update(replicas=3))
    assert layout_changes(current, more) == ["spec.members[1].replicas: 2 -> 3"]
    swapped = example(lambda spec: spec["worlds"][0].update(ranks=["w1", "leader"]))
    assert layout_changes(current, swapped) == ["spec.worlds[0].ranks: ['leader', 'w1'] -> ['w1', 'leader']"]
    renamed = example(lambda spec: spec["worlds"][1].update(name="world3"))
    assert layout_changes(current, renamed) == ["spec.worlds[].name: ['world1', 'world2'] -> ['world1', 'world3']"]


def test_an_edit_of_what_may_change_names_nothing() -> None:
    edited = example(lambda spec: spec["template"]["spec"]["containers"][0].update(args=["--steps", "5"]))
    assert layout_changes(example(), edited) == []
