"""The memory's encoding read back defensively (issue 21 item 6, pure): whatever the memory
ConfigMap holds, reading it either gives the memory or raises CorruptMemory saying what is
wrong, within a bounded amount of memory; and a lost memory is rebuilt from the cluster."""

from __future__ import annotations

import base64
import gzip
import json
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from multiworld_operator.kube.memory.planner_memory import (
    MAX_MEMORY_BYTES,
    MAX_MEMORY_VALUES,
    MEMORY_KEY,
    CorruptMemory,
    json_values,
    loaded_status,
    memory_body,
    read_memory,
    rebuilt_memory,
)
from multiworld_operator.kube.objects.bodies import MEMORY_LABEL
from multiworld_operator.kube.objects.observe import see_pod
from multiworld_operator.spec import parse_manifest
from tests.support.operator_support import manifest

pytestmark = pytest.mark.quick

OWNER = "uid-1"


def holding(packed: bytes | str) -> dict[str, Any]:
    text = packed if isinstance(packed, str) else base64.b64encode(packed).decode()
    return {"metadata": {"name": "mw"}, "binaryData": {MEMORY_KEY: text}}


@pytest.mark.parametrize(
    ("packed", "says"),
    [
        ("not base64!", "not base64"),
        (json.dumps({"worlds": {}}).encode(), "not gzip"),
        (gzip.compress(b"{not json"), "not JSON"),
        (gzip.compress(b"[1, 2]"), "not an object"),
        (gzip.compress(b'{"worlds": {}}')[:-12], "cut short"),
    ],
    ids=["base64", "plain-json", "json", "a-list", "truncated"],
)
def test_a_corrupt_memory_says_what_is_wrong(packed: bytes | str, says: str) -> None:
    with pytest.raises(CorruptMemory, match=says) as raised:
        read_memory(holding(packed))
    assert str(raised.value).count(MEMORY_KEY) == 1  # said once, not wrapped in a second fault


# The most reading any memory may take (tracemalloc's peak): the largest accepted spec's takes
# 34 MiB (bench/scale.py --largest reads it: tests/support/limits_support.py).
READ_PEAK = 64 * 1024 * 1024


def _dicts(count: int) -> bytes:
    """A JSON list of `count` empty objects: 3 bytes each, 64 bytes each once parsed."""
    return b"[" + b"{}," * (count - 1) + b"{}]"


def _strings(size: int) -> bytes:
    """A JSON list of two-letter strings, `size` bytes in all."""
    pairs = [bytes((97 + i % 26, 97 + i // 26 % 26)) for i in range(size // 5)]
    return b"[" + b",".join(b'"' + pair + b'"' for pair in pairs) + b"]"


@pytest.mark.parametrize(
    ("junk", "says"),
    [
        (lambda: b" " * (2 * MAX_MEMORY_BYTES), "larger than"),
        (lambda: _dicts(MAX_MEMORY_BYTES // 3 - 1), "JSON values"),
        (lambda: _dicts(MAX_MEMORY_VALUES - 1), "not an object"),
        (lambda: _strings(MAX_MEMORY_BYTES - 16), "quotes"),
        (lambda: b"[" * (MAX_MEMORY_VALUES - 1), "not JSON"),
        (lambda: b'{"a":' * (MAX_MEMORY_VALUES - 1), "not JSON"),
    ],
    ids=[
        "gzip-bomb",
        "objects-to-the-byte-bound",
        "objects-to-the-value-bound",
        "strings",
        "deep-arrays",
        "deep-objects",
    ],
)
def test_reading_any_memory_takes_a_bounded_amount_of_memory(junk: Callable[[], bytes], says: str) -> None:
    """Whatever a tenant writes in its memory ConfigMap (gzip of at most 1 MiB), reading it
    stops at a bound, or parses it within READ_PEAK: JSON's Python objects take up to 25 times
    the bytes they come from, so the values are counted before json.loads builds any."""
    packed = gzip.compress(junk(), compresslevel=9)
    assert len(packed) < 1024 * 1024  # it fits in a ConfigMap
    tracemalloc.start()
    try:
        with pytest.raises(CorruptMemory, match=says):
            loaded_status(read_memory(holding(packed)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < READ_PEAK, peak


def test_values_are_counted_outside_strings_only() -> None:
    """Brackets, commas and colons in strings (a termination message quoted in the memory) are
    no values; escaped quotes do not end a string; a quote that nothing closes ends the count."""
    assert json_values(b'{"a":1,"b":[1,2,"x,y:[z"]}') == 7  # all but the first key "a"
    assert json_values(b'["\\\\",1,"\\"[,:"]') == 4
    assert json_values(b'[1,"unclosed,:[') == 3


def test_a_memory_that_is_no_status_is_corrupt() -> None:
    with pytest.raises(CorruptMemory, match="not the planner's status"):
        loaded_status({"worlds": {"w": {"epoch": "many"}}})


def test_the_memory_is_labelled_apart_from_the_world_table() -> None:
    body = memory_body({"metadata": {"name": "mw", "uid": OWNER}}, {"worlds": {}})
    assert body["metadata"]["labels"] == {MEMORY_LABEL: "mw"}


def _pod(name: str, created_for: dict[str, int] | None, **labels: str) -> dict[str, Any]:
    annotations = {} if created_for is None else {"multiworld.io/created-for": json.dumps(created_for)}
    return {
        "metadata": {
            "name": name,
            "uid": f"u-{name}",
            "labels": {"multiworld.io/name": "mw", **labels},
            "annotations": annotations,
            "ownerReferences": [{"uid": OWNER, "controller": True, "kind": "MultiWorld", "name": "mw"}],
        },
        "status": {"phase": "Running"},
    }


def test_a_lost_memory_is_rebuilt_from_the_pods_the_view_and_the_spec() -> None:
    """Each pod gets its record (a spare that plays a member pod, under that pod), each world the
    highest epoch anything shows, its ranks and backend from the spec, and its restarts; the next
    spare serial follows the spares found."""
    view = {
        "phase": "Running",
        "restarts": 3,
        "worlds": {
            "wa": {
                "phase": "Running",
                "epoch": 3,
                "size": 2,
                "restarts": 3,
                "lastFailure": {
                    "time": "2026-01-01T00:00:00Z",
                    "reason": "PodFailed",
                    "pod": "mw-a-0",
                    "rank": 1,
                    "epoch": 2,
                },
            },
            "wb": {"phase": "Running", "epoch": 1, "size": 2},
        },
    }
    pods = [
        see_pod(_pod("mw-leader-0", {"wa": 1, "wb": 1}, **{"multiworld.io/member": "leader"}), OWNER),
        see_pod(_pod("mw-b-0", {"wb": 2}, **{"multiworld.io/member": "b"}), OWNER),
        see_pod(_pod("mw-a-spare-c", {}, **{"multiworld.io/spare": "true", "multiworld.io/plays": "mw-a-0"}), OWNER),
    ]
    multiworld = parse_manifest(
        manifest("mw", {"leader": 1, "a": 1, "b": 1}, {"wa": ["leader", "a"], "wb": ["leader", "b"]})
    )
    status = rebuilt_memory(view, pods, multiworld)
    assert status is not None
    assert status.pods["mw-leader-0"].created_for == {"wa": 1, "wb": 1}
    assert status.pods["mw-a-0"].spare == "mw-a-spare-c"
    assert all(record.observed for record in status.pods.values())
    # Each world's epoch is the highest anything shows; its ranks are the spec's, as it formed them.
    assert status.worlds["wa"].epoch == 3 and status.worlds["wb"].epoch == 2
    assert status.worlds["wa"].pods == ["mw-leader-0", "mw-a-0"] and status.worlds["wb"].backend == "gloo"
    assert status.table.worlds == []
    assert status.worlds["wa"].restarts == 3 and len(status.worlds["wa"].recent_restarts) == 1
    assert status.played_by == {"mw-a-0": "mw-a-spare-c"}
    assert status.spare_serial == 3  # "c" is serial 2
    assert rebuilt_memory(None, pods, multiworld) is None
