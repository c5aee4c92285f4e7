"""The MultiWorld resource as pydantic models, loaded and validated in one place.

Public API (stable; the local runner and the Kubernetes operator build on it):

- `load_manifest(path_or_text) -> MultiWorld`: a YAML file path (str or Path) or YAML text
  holding one MultiWorld manifest. `parse_manifest(data: Mapping) -> MultiWorld` does the same
  for an already-parsed dict (e.g. the body kopf hands over). Both raise `SpecError` listing
  the problems at once (up to MAX_PROBLEMS, then how many more), each prefixed by its field
  path: `spec.worlds[1].ranks[2]: member 'w3' is not declared`. Besides the bounds of each
  field, the spec's caps (MAX_PODS, MAX_RANKS, MAX_WORLDS, MAX_WORLDS_PER_POD, MAX_SPEC_BYTES)
  are checked here, each following from a limit of Linux, Kubernetes or the operator.
- `MultiWorld` (`.api_version`, `.kind`, `.metadata: Metadata`, `.spec: MultiWorldSpec`) and
  the helpers on it:
  - `pods_of(member) -> ['<mw>-<member>-0', ...]`, `all_pods() -> [...]` (spec order),
    `member_of_pod(pod) -> (member, ordinal)`;
  - `world(name) -> World`, `world_pods(world) -> [pod, ...]` (the world's ranks expanded:
    rank r is element r), `worlds_of_member(member) -> [world names]`,
    `worlds_of_pod(pod) -> [world names]`, `shared_members() -> [member names]`;
  - `template_of(member) -> dict` (the member's own template, else `spec.template`);
  - `backend_of(world) -> 'nccl' | 'gloo'` (cluster rule: `auto` is nccl when every rank's
    template requests `nvidia.com/gpu`), and `local_backend_of(world, cuda_available) ->
    (backend, warning | None)` (laptop rule: `auto` is nccl when CUDA is available; an explicit
    nccl without CUDA falls back to gloo with a warning for the caller to log).
- `parse_duration("1h30m") -> 5400.0` seconds (units ms, s, m, h, d; `0s` allowed).

Models are frozen; build them only through `parse_manifest`/`load_manifest` (or
`MultiWorld.model_validate`, which runs the same cross-field checks) so every instance is valid.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError

from multiworld.contract import Backend

API_GROUP = "multiworld.io"
API_VERSION = "v1alpha1"
GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"
KIND = "MultiWorld"
PLURAL = "multiworlds"
SINGULAR = "multiworld"
SHORT_NAMES = ["mw"]

BackendChoice = Literal["auto", "nccl", "gloo"]
GPU_RESOURCE = "nvidia.com/gpu"

MAX_LABEL = 63
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Service names (the headless Service is named after the MultiWorld) must start with a letter.
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h|d))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
# Patterns the CRD carries so the API server refuses bad values early; the models check the
# same rules themselves (with messages naming the field) rather than through these.
_NAME_SCHEMA: JsonDict = {"pattern": _DNS1123_LABEL.pattern, "maxLength": MAX_LABEL}
# Upper bounds of every number and duration in the spec: beyond them a value means nothing
# useful, and they keep the planner's arithmetic on times and delays finite.
MAX_DURATION = "366d"
MAX_DURATION_LENGTH = 32
MAX_FACTOR = 100.0
MAX_RESTARTS = 10_000
MAX_SPARES = 64
# Caps that follow from measured limits, each at names of 63 characters (tests/spec/
# test_limits.py builds the largest spec they admit with the real code and holds every object
# written for it to its limit; `bench/scale.py --largest` reports the figures):
# - A pod's worlds: their assignments are one environment string of its container
#   (MULTIWORLD_WORLDS), which Linux caps at 128 KiB (MAX_ARG_STRLEN: past it the container
#   cannot start); its annotations (the operator's created-for stamp) and its worker's status
#   (one line of the worker channel) grow with them too, well within their limits. The
#   environment binds first; the cap keeps it well within its limit.
MAX_WORLDS_PER_POD = 200
# - The longest message the status keeps per world or per pod (why a world failed, why a pod
#   waits), as the caps below assume it; the reasons of workers' reports are taken at this
#   length too.
MAX_MESSAGE = 128
# - A world's last failure quotes the failed pod's termination message, whose opening says what
#   went wrong and how to fix it: room for the longest the worker writes itself (a refused
#   permission and its fix) after the pod's name and rank.
MAX_FAILURE_MESSAGE = 384
# - Worlds and ranks: a MultiWorld's spec, metadata and status are one object, which etcd caps
#   at 1.5 MiB. The status at its largest (every world with a failure of MAX_FAILURE_MESSAGE
#   characters, every rank waiting with a reason of MAX_MESSAGE) grows with the worlds and with
#   the ranks; it must fit beside a spec of MAX_SPEC_BYTES and 256 KiB of annotations, with a
#   fifth to spare.
MAX_WORLDS = 512
MAX_RANKS = 2048
# - Pods (replicas and warm spares of every member): one plan of the largest spec must take
#   under a second, and the operator planning it must stay within the chart's memory limit
#   (charts/multiworld-operator/values.yaml); the time of a first plan grows with pods times
#   ranks. As many as the ranks: every member pod is a rank, and warm spares fit in what is left.
MAX_PODS = MAX_RANKS
MAX_REPLICAS = MAX_PODS
MAX_MEMBERS = MAX_PODS
# - The spec as JSON: it shares the object with the status (above); and a client-side
#   `kubectl apply` keeps a copy of it in an annotation, which must fit in the 256 KiB.
MAX_SPEC_BYTES = 256 * 1024
# - A refusal lists at most MAX_PROBLEMS problems (then how many more), each cut to
#   MAX_PROBLEM_LENGTH characters: the condition SpecValid carries them in the status (Ready
#   too, for a spec that never was valid), which shares the object with the largest spec.
MAX_PROBLEMS = 32

# The worlds' store ports (kube/ports.py, local/store_ports.py): below the kernel's ephemeral
# ports (Linux: 32768+), so no socket gets one unasked (an outgoing connection, a listener on
# port 0) while rank 0 does not serve it. A template may not declare one: the NetworkPolicy
# opens declared ports to everyone, and these must stay open to the MultiWorld's pods only.
PORT_BASE = 20000
PORT_SPAN = 10000
MAX_PROBLEM_LENGTH = 320
# A warm spare is named `<mw>-<member>-spare-<serial in letters>`; its name must fit a label with
# room for this many letters of serial (26**4 spares over a MultiWorld's life).
SPARE_SERIAL_ROOM = 4
_DURATION_SCHEMA: JsonDict = {"pattern": _DURATION.pattern, "maxLength": MAX_DURATION_LENGTH}
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# The cross-field validator raises this error type; parse_manifest reports those problems from
# its own pass over the raw data instead, so they are listed once, next to the field errors.
_CROSS_FIELD_ERROR = "multiworld_spec"


class SpecError(ValueError):
    """An invalid MultiWorld; `problems` holds the problems found, each naming its field: at
    most MAX_PROBLEMS of MAX_PROBLEM_LENGTH characters, then a line saying how many more
    (`count`: all of them)."""

    def __init__(self, problems: list[str]) -> None:
        self.count = len(problems)
        self.problems = [_shortened(p, MAX_PROBLEM_LENGTH) for p in problems[:MAX_PROBLEMS]]
        if self.count > MAX_PROBLEMS:
            self.problems.append(f"and {self.count - MAX_PROBLEMS} more problem(s)")
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid MultiWorld ({self.count} problem(s)):\n{lines}")


def _shortened(text: str, length: int) -> str:
    return text if len(text) <= length else text[: length - 3] + "..."


def parse_duration(text: str) -> float:
    """Seconds in a duration like `30s`, `5m`, `1h`, `1h30m`, `500ms`, `2d`."""
    if not isinstance(text, str) or not _DURATION.match(text):
        raise ValueError(f"{text!r} is not a duration like 30s, 5m, 1h or 1h30m")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(text))


def _check_duration(value: str) -> str:
    if len(value) > MAX_DURATION_LENGTH or parse_duration(value) > parse_duration(MAX_DURATION):
        raise ValueError(f"{value!r} is longer than the maximum duration, {MAX_DURATION}")
    return value


class _SpecModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class Backoff(_SpecModel):
    """Delay before a world's k-th restart within the window: 0 for the first, then
    `initialDelay * factor**(k-2)`, capped at `maxDelay`."""

    initial_delay: str = Field(
        default="1s",
        json_schema_extra=_DURATION_SCHEMA,
        description="Delay before the second restart within the window.",
    )
    max_delay: str = Field(default="1m", json_schema_extra=_DURATION_SCHEMA, description="Longest delay.")
    factor: float = Field(
        default=2.0, ge=1.0, le=MAX_FACTOR, description="Each further restart waits this many times longer."
    )

    _durations = field_validator("initial_delay", "max_delay")(_check_duration)

    def delay(self, recent_restarts: int) -> float:
        """Seconds to wait before a restart preceded by `recent_restarts` within the window."""
        if recent_restarts <= 0:
            return 0.0
        longest = parse_duration(self.max_delay)
        delay = parse_duration(self.initial_delay)
        for _ in range(recent_restarts - 1):  # grows step by step: a power could overflow
            if delay >= longest:
                break
            delay *= self.factor
        return min(longest, delay)


ReplaceChoice = Literal["Pod", "World"]


class FailurePolicy(_SpecModel):
    """At most `maxRestarts` restarts of a world within any `window`; then the world is Failed.
    `replace` says which pods a failure costs: `Pod` only those that are gone (ended, named by a
    live peer, or not joined the new epoch within `joinTimeout`); `World` every pod of the world
    that is in no other healthy world."""

    max_restarts: int = Field(default=10, ge=0, le=MAX_RESTARTS, description="Restarts allowed within `window`.")
    window: str = Field(
        default="1h", json_schema_extra=_DURATION_SCHEMA, description="A duration such as 30s, 5m, 1h or 1h30m."
    )
    backoff: Backoff = Field(default_factory=Backoff, description="Delays between restarts; the first is immediate.")
    replace: ReplaceChoice = Field(
        default="Pod",
        description="Pod: a failure replaces only the pods that are gone (ended, named by a live peer as the "
        "culprit, or not joined the new epoch within joinTimeout); the others join the new epoch. World: every "
        "pod of the world that is in no other healthy world is replaced (programs that must restart together).",
    )
    join_timeout: str = Field(
        default="5m",
        json_schema_extra=_DURATION_SCHEMA,
        description="How long a kept pod may take to join its world's new epoch before it is replaced.",
    )

    _window = field_validator("window", "join_timeout")(_check_duration)

    @property
    def window_seconds(self) -> float:
        return parse_duration(self.window)

    @property
    def join_timeout_seconds(self) -> float:
        return parse_duration(self.join_timeout)


class Member(_SpecModel):
    """A set of identical pods `<mw>-<name>-<ordinal>`, declared once, used by many worlds."""

    name: str = Field(json_schema_extra=_NAME_SCHEMA)
    replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS, description="Pods of this member, ordinals 0..replicas-1.")
    template: dict[str, Any] | None = Field(
        default=None, description="A PodTemplateSpec replacing spec.template for this member."
    )
    spares: int = Field(
        default=0,
        ge=0,
        le=MAX_SPARES,
        description="Warm spare pods of this member's template kept running, each waiting in init_from_env() "
        "for an identity: a failed pod of this member is replaced by a spare instead of a new pod.",
    )


class World(_SpecModel):
    """One communication group: the members' pods in rank order."""

    name: str = Field(json_schema_extra=_NAME_SCHEMA)
    ranks: list[str] = Field(
        max_length=MAX_MEMBERS,
        json_schema_extra={"items": {"type": "string", **_NAME_SCHEMA}},
        description="Member names; each expands to its pods in ordinal order, rank r is the r-th pod.",
    )
    backend: BackendChoice | None = Field(default=None, description="Overrides spec.backend for this world.")
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy)


class UpdateStrategy(_SpecModel):
    """How an edited member template rolls out: pod by pod, each old pod replaced by one of the
    new template (a ready warm spare of the new template plays it when there is one)."""

    max_unavailable: int = Field(
        default=1,
        ge=1,
        le=MAX_REPLICAS,
        description="Most member pods not ready at once (for any cause) while old pods are replaced; a world "
        "whose old pods all fit moves once.",
    )
    max_surge: int = Field(
        default=1,
        ge=1,
        le=MAX_PODS,
        description="Most warm spares starting at once while a rollout runs (until every member keeps its spares of "
        "the new template again); members with old pods get theirs first. More rolls faster where the machines "
        "have room; each starting spare loads its program beside the serving pods.",
    )
    paused: bool = Field(default=False, description="true holds the rollout: no old pod is replaced for it.")


class MultiWorldSpec(_SpecModel):
    backend: BackendChoice = Field(
        default="auto", description="auto: nccl when every rank of a world requests nvidia.com/gpu, else gloo."
    )
    template: dict[str, Any] = Field(default_factory=dict, description="The default PodTemplateSpec of every member.")
    network_policy: bool = Field(
        default=True,
        description="A NetworkPolicy admitting traffic to the pods only from this MultiWorld's own pods (any port: "
        "stores and communicators) and from anywhere on the ports the templates declare.",
    )
    suspend: bool = Field(
        default=False,
        description="true deletes every pod and warm spare and keeps each world's epoch, history and restart "
        "budget; false again brings them back, each world at its next epoch (what queueing systems such as Kueue "
        "set to admit a workload).",
    )
    update_strategy: UpdateStrategy = Field(
        default_factory=UpdateStrategy, description="How a template edit rolls out to running pods."
    )
    members: list[Member] = Field(
        min_length=1,
        max_length=MAX_MEMBERS,
        description=f"Pods, declared once: at most {MAX_PODS} in all (replicas and spares); a member's pods are "
        f"in at most {MAX_WORLDS_PER_POD} worlds.",
    )
    worlds: list[World] = Field(
        min_length=1,
        max_length=MAX_WORLDS,
        description=f"Communication groups, many-to-many with members: at most {MAX_RANKS} ranks in all after "
        "expanding replicas.",
    )


class Metadata(BaseModel):
    """The parts of ObjectMeta the controller reads; everything else is kept as is."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str
    namespace: str | None = None
    generation: int | None = None
    uid: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


_Named = TypeVar("_Named", Member, World)


class MultiWorld(_SpecModel):
    api_version: Literal["multiworld.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["MultiWorld"]
    metadata: Metadata
    spec: MultiWorldSpec
    # Manifests read back from a cluster carry a status; the spec models ignore it.
    status: dict[str, Any] | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _cross_field_checks(self) -> MultiWorld:
        problems = cross_field_problems(self.model_dump(by_alias=True))
        if problems:
            raise PydanticCustomError(_CROSS_FIELD_ERROR, "{problems}", {"problems": "; ".join(problems)})
        return self

    @property
    def name(self) -> str:
        return self.metadata.name

    # -- members and pods -------------------------------------------------------------------

    # Lookups are indexed once per (immutable) model: the planner asks them for every pod of
    # every world, which scanned lists made cubic in the number of members.
    @cached_property
    def _members(self) -> dict[str, Member]:
        return {m.name: m for m in self.spec.members}

    @cached_property
    def _worlds(self) -> dict[str, World]:
        return {w.name: w for w in self.spec.worlds}

    @cached_property
    def _pod_index(self) -> dict[str, tuple[str, int]]:
        return {pod_name(self.name, m.name, i): (m.name, i) for m in self.spec.members for i in range(m.replicas)}

    @cached_property
    def _member_worlds(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {m.name: [] for m in self.spec.members}
        for w in self.spec.worlds:
            for member in dict.fromkeys(w.ranks):
                if member in found:
                    found[member].append(w.name)
        return found

    def member(self, name: str) -> Member:
        return self._declared(self._members, "member", name)

    def pods_of(self, member: str) -> list[str]:
        return [pod_name(self.name, member, i) for i in range(self.member(member).replicas)]

    def all_pods(self) -> list[str]:
        return list(self._pod_index)

    def member_of_pod(self, pod: str) -> tuple[str, int]:
        try:
            return self._pod_index[pod]
        except KeyError:
            raise KeyError(f"pod {pod!r} belongs to no member of MultiWorld {self.name!r}") from None

    def template_of(self, member: str) -> dict[str, Any]:
        own = self.member(member).template
        return own if own is not None else self.spec.template

    def template_digest(self, member: str) -> str:
        """A digest of the member's template: a warm spare serves only the template it was made from."""
        return self._template_digests[member]

    @cached_property
    def _template_digests(self) -> dict[str, str]:
        texts = {
            m.name: json.dumps(self.template_of(m.name), sort_keys=True, separators=(",", ":"))
            for m in self.spec.members
        }
        return {name: hashlib.sha256(text.encode()).hexdigest()[:16] for name, text in texts.items()}

    # -- worlds -----------------------------------------------------------------------------

    def world(self, name: str) -> World:
        return self._declared(self._worlds, "world", name)

    def _declared(self, items: Mapping[str, _Named], what: str, name: str) -> _Named:
        found = items.get(name)
        if found is None:
            raise KeyError(f"{what} {name!r} is not declared in MultiWorld {self.name!r}")
        return found

    @cached_property
    def _world_pods(self) -> dict[str, list[str]]:
        return {w.name: [pod for member in w.ranks for pod in self.pods_of(member)] for w in self.spec.worlds}

    def world_pods(self, world: str) -> list[str]:
        self.world(world)  # an undeclared world is an error, named
        return list(self._world_pods[world])

    def worlds_of_member(self, member: str) -> list[str]:
        return list(self._member_worlds.get(member, []))

    def worlds_of_pod(self, pod: str) -> list[str]:
        member, _ = self.member_of_pod(pod)
        return self.worlds_of_member(member)

    def shared_members(self) -> list[str]:
        return [m.name for m in self.spec.members if len(self.worlds_of_member(m.name)) > 1]

    def backend_of(self, world: str) -> Backend:
        choice = self.world(world).backend or self.spec.backend
        if choice != "auto":
            return choice
        gpus = all(requests_gpu(self.template_of(m)) for m in self.world(world).ranks)
        return "nccl" if gpus else "gloo"

    def local_backend_of(self, world: str, cuda_available: bool) -> tuple[Backend, str | None]:
        choice = self.world(world).backend or self.spec.backend
        if choice == "auto":
            return ("nccl" if cuda_available else "gloo"), None
        if choice == "nccl" and not cuda_available:
            return "gloo", f"world {world!r}: backend nccl needs CUDA, which is not available here; using gloo"
        return choice, None


def pod_name(multiworld: str, member: str, ordinal: int) -> str:
    return f"{multiworld}-{member}-{ordinal}"


def spare_name(multiworld: str, member: str, serial: int) -> str:
    """`<mw>-<member>-spare-<serial in letters>`: a name ending in a letter is never a member
    pod's, whose ordinal is digits."""
    letters = ""
    serial += 1
    while serial > 0:
        serial, digit = divmod(serial - 1, 26)
        letters = chr(ord("a") + digit) + letters
    return f"{multiworld}-{member}-spare-{letters}"


def requests_gpu(template: Mapping[str, Any]) -> bool:
    """Whether any container of a PodTemplateSpec asks for at least one `nvidia.com/gpu`."""
    containers = _get(_get(template, "spec"), "containers")
    for container in containers if isinstance(containers, list) else []:
        resources = _get(container, "resources")
        for kind in ("limits", "requests"):
            amount = _get(_get(resources, kind), GPU_RESOURCE)
            if _positive_quantity(amount):
                return True
    return False


def _positive_quantity(value: object) -> bool:
    try:
        return float(str(value)) > 0
    except ValueError:
        return False


# -- loading and validation ------------------------------------------------------------------


def load_manifest(source: str | Path) -> MultiWorld:
    """Load a MultiWorld from a YAML file (a Path, or a str naming an existing file) or YAML text."""
    text, name = (source.read_text(), str(source)) if isinstance(source, Path) else _text_of(source)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError([_yaml_problem(exc, name)]) from exc
    return parse_manifest(data)


def _text_of(source: str) -> tuple[str, str]:
    """The YAML text and what to call it in errors: the file's name, or `manifest`."""
    # One line naming a file is a path; one line without YAML structure must be one too.
    if "\n" not in source:
        if Path(source).is_file():
            return Path(source).read_text(), source
        if ":" not in source:
            raise SpecError([f"manifest: no such file {source!r}"])
    return source, "manifest"


def _yaml_problem(error: yaml.YAMLError, name: str) -> str:
    """A YAML error as one line naming the file and where in it (yaml's own message names a
    stream, not the file)."""
    if not isinstance(error, yaml.MarkedYAMLError):
        return f"{name}: not valid YAML: {error}"
    mark = error.problem_mark or error.context_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = "; ".join(part for part in (error.context, error.problem) if part)
    return f"{name}: not valid YAML{where}: {what}"


def parse_manifest(data: object) -> MultiWorld:
    """Validate a parsed manifest; raise SpecError listing every problem."""
    if not isinstance(data, Mapping):
        raise SpecError([f"manifest: expected a mapping (a MultiWorld object), got {type(data).__name__}"])
    problems = cross_field_problems(data)
    try:
        multiworld = MultiWorld.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_field_problems(exc) + problems) from None
    return multiworld


def _field_problems(exc: ValidationError) -> list[str]:
    problems = []
    for error in exc.errors():
        if error["type"] == _CROSS_FIELD_ERROR:
            continue
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"{field_path(error['loc'])}: {message}")
    return problems


def field_path(loc: tuple[str | int, ...]) -> str:
    """('spec', 'worlds', 1, 'ranks', 2) -> 'spec.worlds[1].ranks[2]'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "manifest"


def cross_field_problems(data: Mapping[str, Any]) -> list[str]:
    """Problems that span fields (names, references, sizes), read tolerantly from raw data so
    they are reported together with type errors found elsewhere."""
    problems: list[str] = []
    mw_name = _get(data.get("metadata"), "name")
    if isinstance(mw_name, str):
        problems += _label_problems("metadata.name", mw_name, _DNS1035_LABEL, "a letter")
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
    """A container port the templates declare inside the store ports' range."""
    templates = [("spec.template", _get(spec, "template"))]
    templates += [(f"spec.members[{i}].template", member.get("template")) for i, member in _items(spec, "members")]
    problems = []
    for path, template in templates:
        for c, container in enumerate(_list(_get(_get(template, "spec"), "containers"))):
            for p, port in enumerate(_list(_get(container, "ports"))):
                number = _get(port, "containerPort")
                if isinstance(number, int) and PORT_BASE <= number < PORT_BASE + PORT_SPAN:
                    problems.append(
                        f"{path}.spec.containers[{c}].ports[{p}].containerPort: {number} is in "
                        f"{PORT_BASE}-{PORT_BASE + PORT_SPAN - 1}, the worlds' store ports (open only to the "
                        "MultiWorld's own pods); declare another port"
                    )
    return problems


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _count(member: Mapping[str, Any], key: str, default: int) -> int:
    """A member's replicas or spares when valid (invalid ones are named elsewhere), else 0."""
    value = member.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _member_problems(spec: object, mw_name: str | None, problems: list[str]) -> dict[str, int | None]:
    """Check member names; return declared member -> replicas (None when replicas is invalid)."""
    declared: dict[str, int | None] = {}
    for index, member in _items(spec, "members"):
        name = member.get("name")
        if not isinstance(name, str):
            continue
        path = f"spec.members[{index}].name"
        label = _label_problems(path, name, _DNS1123_LABEL)
        problems += label
        if name in declared:
            problems.append(f"{path}: member {name!r} is declared twice")
            continue
        count = member.get("replicas", 1)
        declared[name] = count if isinstance(count, int) and not isinstance(count, bool) and count >= 1 else None
        longest = pod_name(mw_name, name, (declared[name] or 1) - 1) if mw_name else ""
        if not label and len(longest) > MAX_LABEL:
            problems.append(
                f"{path}: pod name {longest!r} is {len(longest)} characters; "
                f"<name>-<member>-<ordinal> must fit in {MAX_LABEL}"
            )
        spares = member.get("spares", 0)
        spare = f"{mw_name}-{name}-spare-" + "a" * SPARE_SERIAL_ROOM if mw_name else ""
        if not label and isinstance(spares, int) and spares > 0 and len(spare) > MAX_LABEL:
            problems.append(
                f"spec.members[{index}].spares: spare pod names {spare!r} would be {len(spare)} characters; "
                f"<name>-<member>-spare-<serial> must fit in {MAX_LABEL} (a shorter member or MultiWorld name)"
            )
    return declared


def _world_problems(spec: object, replicas: Mapping[str, int | None], problems: list[str]) -> tuple[Counter[str], int]:
    """Check world names and rank lists; return how many worlds use each member, and the ranks
    of every world whose size is known."""
    used: Counter[str] = Counter()
    total = 0
    seen_worlds: set[str] = set()
    for index, world in _items(spec, "worlds"):
        name = world.get("name")
        label = name if isinstance(name, str) else f"#{index}"
        if isinstance(name, str):
            problems += _label_problems(f"spec.worlds[{index}].name", name, _DNS1123_LABEL)
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


def _label_problems(path: str, value: str, pattern: re.Pattern[str], first: str = "a letter or digit") -> list[str]:
    if len(value) > MAX_LABEL or not pattern.match(value):
        return [
            f"{path}: {value!r} is not a valid name (a DNS label: at most {MAX_LABEL} characters "
            f"of a-z, 0-9 and '-', starting with {first} and ending with a letter or digit)"
        ]
    return []


def _items(spec: object, key: str) -> Iterator[tuple[int, Mapping[str, Any]]]:
    items = _get(spec, key)
    if isinstance(items, list):
        for index, item in enumerate(items):
            if isinstance(item, Mapping):
                yield index, item


def _get(obj: object, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else None
