"""The planner's memory on Kubernetes (pure): the whole MultiWorldStatus as gzipped JSON in the
ConfigMap named like the MultiWorld, written before the table and the pods it speaks of.

The CR's status carries only the view (what kubectl shows). The rest (each world's formation
and restart history, the record of every pod instance asked for, the table's revision) is what
the planner needs to plan again after the operator restarts, and nobody else reads it; kept out
of the MultiWorld, it costs the clients that watch MultiWorlds nothing. Gzipped, because it
repeats pod and world names: thousands of worlds stay far below the 1 MiB object limit.

Labelled MEMORY_LABEL, not NAME_LABEL like the world table's ConfigMaps, so that deleting the
table by label leaves the memory. The ConfigMap is in the tenant's namespace, and the tenant may
write it: what reading it costs is bounded whatever it holds. A memory that cannot be read (not
base64, not gzip, larger than MAX_MEMORY_BYTES once decompressed: a gzip bomb is stopped there;
more than MAX_MEMORY_VALUES JSON values, counted before any is built; not JSON, or nested past
the parser's depth; not a status) is CorruptMemory; a lost or corrupt memory is rebuilt from
what the cluster still shows (`rebuilt_memory`).
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

from multiworld.contract import WorldTable
from multiworld_operator.kube.objects.bodies import MEMORY_LABEL, owner_reference
from multiworld_operator.kube.objects.observe import SeenPod
from multiworld_operator.planner.status import MultiWorldStatus, PodRecord, WorldStatus
from multiworld_operator.spec import MultiWorld

MEMORY_KEY = "status.json.gz"
# The most a memory may take once decompressed, and the most JSON values it may hold. The
# largest accepted spec's memory at its largest (every pod failed and waiting, every world's
# restart history full: tests/support/limits_support.py measures it, test_limits.py holds it
# within these) is 3.5 MiB of 192 thousand values, and 34 MiB once read. JSON's Python objects
# take up to 25 times the bytes they are parsed from (`{},` a dict of 64 bytes): the count of
# values, taken on the bytes before json.loads builds anything, is what bounds the memory a
# read may take (about 100 bytes a value, plus the bytes themselves), and the bytes its time.
MAX_MEMORY_BYTES = 6 * 1024 * 1024
MAX_MEMORY_VALUES = 400_000


class CorruptMemory(ValueError):
    """The memory ConfigMap holds something that is not a memory; the message says what."""


def memory_body(multiworld: Mapping[str, Any], memory: Mapping[str, Any]) -> dict[str, Any]:
    name = multiworld["metadata"]["name"]
    raw = json.dumps(memory, separators=(",", ":")).encode()
    # mtime 0: the same memory always makes the same bytes.
    packed = gzip.compress(raw, compresslevel=1, mtime=0)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": {MEMORY_LABEL: name}, "ownerReferences": [owner_reference(multiworld)]},
        "binaryData": {MEMORY_KEY: base64.b64encode(packed).decode()},
    }


def packed_memory(configmap: Mapping[str, Any]) -> str | None:
    """The memory's bytes as the ConfigMap holds them (base64), if it holds any."""
    packed = (configmap.get("binaryData") or {}).get(MEMORY_KEY)
    return None if packed is None else str(packed)


def read_memory(configmap: Mapping[str, Any]) -> dict[str, Any] | None:
    """The memory a ConfigMap holds; None when it holds none; CorruptMemory when what it holds
    is no memory (never more than MAX_MEMORY_BYTES decompressed)."""
    packed = packed_memory(configmap)
    if packed is None:
        return None
    try:
        compressed = base64.b64decode(packed, validate=True)
    except (binascii.Error, ValueError) as error:
        raise CorruptMemory(f"{MEMORY_KEY} is not base64: {error}") from None
    raw = _gunzip(compressed)
    # Each string is a value (two quotes): past that many quotes, there is no need to count.
    quotes = raw.count(b'"')
    if quotes > 2 * MAX_MEMORY_VALUES:
        raise CorruptMemory(f"{MEMORY_KEY} holds {quotes} quotes, more than {MAX_MEMORY_VALUES} values' worth")
    values = json_values(raw)
    if values > MAX_MEMORY_VALUES:
        raise CorruptMemory(f"{MEMORY_KEY} holds {values} JSON values, more than the {MAX_MEMORY_VALUES} a memory may")
    try:
        memory = json.loads(raw)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptMemory(f"{MEMORY_KEY} is not JSON: {error}") from None
    if not isinstance(memory, dict):
        raise CorruptMemory(f"{MEMORY_KEY} holds a JSON {type(memory).__name__}, not an object")
    return memory


def _gunzip(compressed: bytes) -> bytes:
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        raw = inflater.decompress(compressed, MAX_MEMORY_BYTES + 1)
    except zlib.error as error:
        raise CorruptMemory(f"{MEMORY_KEY} is not gzip: {error}") from None
    if len(raw) > MAX_MEMORY_BYTES:
        raise CorruptMemory(f"{MEMORY_KEY} is larger than {MAX_MEMORY_BYTES} bytes once decompressed")
    if not inflater.eof:
        raise CorruptMemory(f"{MEMORY_KEY} is cut short (its gzip stream does not end)")
    return raw


# Every byte but a quote and the three that come before a value.
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"[,:')


def json_values(raw: bytes) -> int:
    """How many values JSON text `raw` holds as json.loads would build them (objects, arrays,
    keys, strings, numbers, literals), but an object's first key: every one but the first
    follows a `[`, a `,` or a `:` outside strings. Escaped backslashes and quotes dropped, every
    quote opens or closes a string (a backslash outside one ends what json.loads reads: what
    follows it may count wrong, and is never built). Bytes operations only: a list of a piece
    per string at most, no value built."""
    bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    return 1 + sum(map(len, bare.split(b'"')[::2]))


def loaded_status(memory: Mapping[str, Any] | None) -> MultiWorldStatus | None:
    """The planner's status from a stored memory; CorruptMemory when it is not one."""
    try:
        return MultiWorldStatus.from_dict(memory)
    except ValueError as error:  # pydantic's ValidationError is one
        raise CorruptMemory(f"{MEMORY_KEY} is not the planner's status: {error}") from None


def rebuilt_memory(
    view: Mapping[str, Any] | None, pods: Iterable[SeenPod], multiworld: MultiWorld
) -> MultiWorldStatus | None:
    """The planner's memory rebuilt from what the cluster still shows, when it was lost: the
    CR's status (each world's phase, epoch, restarts and last failure; the conditions), our pods
    (a record of each instance from its created-for stamp, which warm spare plays which member
    pod) and the spec (each world's ranks and backend, as it formed them, so that the first step
    publishes each world's entry as its workers hold it). Every pod found is recorded as
    observed, so none is deleted as unknown; each world's epoch is the highest any of them
    shows. A world's restarts within its window are not known: the last failure counts as one
    (the rest of the budget is given back). What it cannot rebuild: warm spares that play
    nothing (their template is not known: they are replaced), and a spec edited while the memory
    was lost (the edited worlds form again at a new epoch). None when there is nothing to
    rebuild from."""
    try:
        status = MultiWorldStatus.from_dict(view) if view and view.get("worlds") else None
    except ValueError:
        status = None
    if status is None:
        return None
    pods_seen = list(pods)
    records: dict[str, PodRecord] = {}
    spares: dict[str, str] = {}  # member pod -> the spare that plays it
    for pod in pods_seen:
        seen = pod.observation
        if seen is None:
            continue
        if pod.plays:  # a warm spare's stamp is the epochs it was given a member pod at
            spares[pod.plays] = pod.name
            records[pod.plays] = PodRecord(created_for=dict(seen.created_for), observed=True, spare=pod.name)
        elif seen.created_for:
            records[pod.name] = PodRecord(created_for=dict(seen.created_for), observed=True)
    worlds: dict[str, WorldStatus] = {}
    for name, world in status.worlds.items():
        epochs = [world.epoch, *(r.created_for[name] for r in records.values() if name in r.created_for)]
        update: dict[str, Any] = {"epoch": max(epochs)}
        if name in {w.name for w in multiworld.spec.worlds}:
            update.update(pods=multiworld.world_pods(name), backend=multiworld.backend_of(name))
        if world.last_failure is not None and world.restarts:
            update.update(recent_restarts=[world.last_failure.time], earlier_restarts=[])
        worlds[name] = world.model_copy(update=update)
    serials = [_spare_serial(pod.name) for pod in pods_seen if SPARE_MARK in pod.name]
    return status.model_copy(
        update={
            "worlds": worlds,
            "pods": records,
            "table": WorldTable(),
            "played_by": dict(spares),
            "spare_serial": max((s + 1 for s in serials if s is not None), default=0),
        }
    )


SPARE_MARK = "-spare-"


def _spare_serial(name: str) -> int | None:
    """The serial of a warm spare named by spec.spare_name (its letters read back)."""
    letters = name.rsplit(SPARE_MARK, 1)[-1]
    if not letters or not all("a" <= ch <= "z" for ch in letters):
        return None
    value = 0
    for ch in letters:
        value = value * 26 + ord(ch) - ord("a") + 1
    return value - 1
