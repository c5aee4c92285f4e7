"""The checks that span fields: names declared twice, ranks naming no member, worlds too small,
members in no world, pod and spare names too long, the caps on pods, ranks, worlds per pod and
the spec's size, and store ports declared in a template; and how deeply the spec nests
(`nesting_problems`, judged first: the others may recurse into it).

They read the raw manifest tolerantly (a value of the wrong type is skipped: the models name
it), so `parse_manifest` reports them together with the models' field errors, which keep a
model's own validators from running. Every problem names its field the way the models' errors
do: `spec.worlds[1].ranks[2]: member 'w3' is not declared`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from multiworld_operator.spec.limits import (
    MAX_PODS,
    MAX_RANKS,
    MAX_SPEC_BYTES,
    MAX_SPEC_DEPTH,
    MAX_WORLDS_PER_POD,
    PORT_BASE,
    PORT_SPAN,
)
from multiworld_operator.spec.names import MAX_LABEL, SPARE_SERIAL_ROOM, is_label, pod_name


def nesting_problems(data: Mapping[str, Any]) -> list[str]:
    """A spec nested deeper than MAX_SPEC_DEPTH, named by the field it is deepest under (its
    first four steps), found without recursion: any depth the API server stores is walked."""
    pending: list[tuple[object, int, str]] = [(data.get("spec"), 1, "spec")]
    too_deep: dict[str, None] = {}
    while pending:
        value, depth, path = pending.pop()
        if isinstance(value, Mapping):
            children: Iterator[tuple[str, object]] = ((f".{key}", child) for key, child in value.items())
        elif isinstance(value, list):
            children = ((f"[{index}]", child) for index, child in enumerate(value))
        else:
            continue
        if depth > MAX_SPEC_DEPTH:
            too_deep[path] = None
            continue
        named = depth <= 4  # the path keeps its first four steps only
        pending.extend((child, depth + 1, path + step if named else path) for step, child in children)
    return [f"{path}: nested more than {MAX_SPEC_DEPTH} levels deep" for path in too_deep]


def cross_field_problems(data: Mapping[str, Any]) -> list[str]:
    """The problems that span fields of a manifest (a parsed mapping, valid or not)."""
    problems: list[str] = []
    mw_name = get(data.get("metadata"), "name")
    spec = data.get("spec")
    problems += _spec_size_problems(spec)
    problems += _store_port_problems(spec)
    replicas = _member_problems(spec, mw_name if isinstance(mw_name, str) else None, problems)
    worlds_of, ranks = _world_problems(spec, replicas, problems)
    reported: set[str] = set()
    for index, member in _items(spec, "members"):
        name = member.get("name")
        if not isinstance(name, str) or name not in replicas or name in reported:
            continue
        reported.add(name)
        if not worlds_of[name]:
            problems.append(f"spec.members[{index}]: member {name!r} is in no world")
        elif worlds_of[name] > MAX_WORLDS_PER_POD:
            problems.append(
                f"spec.members[{index}]: member {name!r} is in {worlds_of[name]} worlds; "
                f"a pod may be in at most {MAX_WORLDS_PER_POD}"
            )
    pods = sum(_count(m, "replicas", 1) + _count(m, "spares", 0) for _, m in _items(spec, "members"))
    if pods > MAX_PODS:
        problems.append(f"spec.members: {pods} pods in all (replicas and spares of every member); at most {MAX_PODS}")
    if ranks > MAX_RANKS:
        problems.append(f"spec.worlds: {ranks} ranks in all worlds after expanding replicas; at most {MAX_RANKS}")
    return problems


def _spec_size_problems(spec: object) -> list[str]:
    try:
        size = len(json.dumps(spec, separators=(",", ":"), ensure_ascii=False, default=str).encode())
    except (TypeError, ValueError):  # keys JSON cannot hold: the models name them
        return []
    if size <= MAX_SPEC_BYTES:
        return []
    return [
        f"spec: {size} bytes as JSON; at most {MAX_SPEC_BYTES} (the status shares the object with it, "
        "and `kubectl apply` keeps a copy of it in an annotation)"
    ]


def _store_port_problems(spec: object) -> list[str]:
    """A container port the templates declare inside the store ports' range (the models keep a
    template whole, so only this check names a field inside one)."""
    templates = [("spec.template", get(spec, "template"))]
    templates += [(f"spec.members[{i}].template", member.get("template")) for i, member in _items(spec, "members")]
    problems = []
    for path, template in templates:
        for c, container in enumerate(_list(get(get(template, "spec"), "containers"))):
            for p, port in enumerate(_list(get(container, "ports"))):
                number = get(port, "containerPort")
                if isinstance(number, int) and PORT_BASE <= number < PORT_BASE + PORT_SPAN:
                    problems.append(
                        f"{path}.spec.containers[{c}].ports[{p}].containerPort: {number} is in "
                        f"{PORT_BASE}-{PORT_BASE + PORT_SPAN - 1}, the worlds' store ports (open only to the "
                        "MultiWorld's own pods); declare another port"
                    )
    return problems


def _member_problems(spec: object, mw_name: str | None, problems: list[str]) -> dict[str, int | None]:
    """Check that member names are declared once and make pod and spare names that fit a label
    (a name that is no label is the models' to name); return declared member -> replicas (None
    when replicas is invalid)."""
    declared: dict[str, int | None] = {}
    for index, member in _items(spec, "members"):
        name = member.get("name")
        if not isinstance(name, str):
            continue
        path = f"spec.members[{index}].name"
        if name in declared:
            problems.append(f"{path}: member {name!r} is declared twice")
            continue
        count = member.get("replicas", 1)
        declared[name] = count if isinstance(count, int) and not isinstance(count, bool) and count >= 1 else None
        if not mw_name or not is_label(name):
            continue
        longest = pod_name(mw_name, name, (declared[name] or 1) - 1)
        if len(longest) > MAX_LABEL:
            problems.append(
                f"{path}: pod name {longest!r} is {len(longest)} characters; "
                f"<name>-<member>-<ordinal> must fit in {MAX_LABEL}"
            )
        spares = member.get("spares", 0)
        spare = f"{mw_name}-{name}-spare-" + "a" * SPARE_SERIAL_ROOM
        if isinstance(spares, int) and spares > 0 and len(spare) > MAX_LABEL:
            problems.append(
                f"spec.members[{index}].spares: spare pod names {spare!r} would be {len(spare)} characters; "
                f"<name>-<member>-spare-<serial> must fit in {MAX_LABEL} (a shorter member or MultiWorld name)"
            )
    return declared


def _world_problems(spec: object, replicas: Mapping[str, int | None], problems: list[str]) -> tuple[Counter[str], int]:
    """Check that world names are declared once and rank lists name declared members once each,
    for at least 2 ranks; return how many worlds use each member, and the ranks of every world
    whose size is known."""
    used: Counter[str] = Counter()
    total = 0
    seen_worlds: set[str] = set()
    for index, world in _items(spec, "worlds"):
        name = world.get("name")
        label = name if isinstance(name, str) else f"#{index}"
        if isinstance(name, str):
            if name in seen_worlds:
                problems.append(f"spec.worlds[{index}].name: world {name!r} is declared twice")
            seen_worlds.add(name)
        ranks = world.get("ranks")
        if not isinstance(ranks, list):
            continue
        size: int | None = 0
        in_world: set[str] = set()
        for position, member in enumerate(ranks):
            if not isinstance(member, str):
                size = None
                continue
            path = f"spec.worlds[{index}].ranks[{position}]"
            if member not in replicas:
                problems.append(f"{path}: member {member!r} is not declared")
                size = None
            elif member in in_world:
                problems.append(f"{path}: member {member!r} appears twice in world {label!r}")
            else:
                used[member] += 1
                count = replicas[member]
                size = None if size is None or count is None else size + count
            in_world.add(member)
        if size is not None and size < 2:
            problems.append(
                f"spec.worlds[{index}].ranks: world {label!r} has {size} rank(s) after expanding "
                "replicas; a world needs at least 2"
            )
        total += size or 0
    return used, total


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _count(member: Mapping[str, Any], key: str, default: int) -> int:
    """A member's replicas or spares when valid (invalid ones are named elsewhere), else 0."""
    value = member.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _items(spec: object, key: str) -> Iterator[tuple[int, Mapping[str, Any]]]:
    items = get(spec, key)
    if isinstance(items, list):
        for index, item in enumerate(items):
            if isinstance(item, Mapping):
                yield index, item


def get(obj: object, key: str) -> Any:
    """`obj[key]` when `obj` is a mapping, else None: a tolerant read of raw data."""
    return obj.get(key) if isinstance(obj, Mapping) else None
