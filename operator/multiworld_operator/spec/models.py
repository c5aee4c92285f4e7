"""The MultiWorld resource as pydantic models, and what the platforms ask of it.

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

Each field checks its own bounds and names (pydantic names the field of every error); the checks
that span fields are `cross_field.py`'s, which `MultiWorld` runs too. Models are frozen; build
them only through `parse_manifest`/`load_manifest` (or `MultiWorld.model_validate`, which runs
the same checks) so every instance is valid.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError

from multiworld.contract import Backend
from multiworld_operator.spec.cross_field import cross_field_problems, get
from multiworld_operator.spec.durations import DURATION, check_duration, parse_duration
from multiworld_operator.spec.limits import (
    MAX_DURATION_LENGTH,
    MAX_FACTOR,
    MAX_MEMBERS,
    MAX_PODS,
    MAX_RANKS,
    MAX_REPLICAS,
    MAX_RESTARTS,
    MAX_SPARES,
    MAX_WORLDS,
    MAX_WORLDS_PER_POD,
)
from multiworld_operator.spec.names import DNS1035_LABEL, DNS1123_LABEL, MAX_LABEL, check_label, pod_name

BackendChoice = Literal["auto", "nccl", "gloo"]
GPU_RESOURCE = "nvidia.com/gpu"
# Patterns the CRD carries so the API server refuses bad values early; the models check the
# same rules themselves (with messages naming the field) rather than through these.
_NAME_SCHEMA: JsonDict = {"pattern": DNS1123_LABEL.pattern, "maxLength": MAX_LABEL}
_DURATION_SCHEMA: JsonDict = {"pattern": DURATION.pattern, "maxLength": MAX_DURATION_LENGTH}
# The error type of MultiWorld's cross-field validator: parse_manifest reports those problems
# from its own pass over the raw data instead, so they are listed once, next to the field errors.
CROSS_FIELD_ERROR = "multiworld_spec"


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

    _durations = field_validator("initial_delay", "max_delay")(check_duration)

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

    _window = field_validator("window", "join_timeout")(check_duration)

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

    _name = field_validator("name")(check_label)


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

    _name = field_validator("name")(check_label)


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

    @field_validator("name")
    @classmethod
    def _name_is_a_service_name(cls, name: str) -> str:
        return check_label(name, DNS1035_LABEL, "a letter")


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
            raise PydanticCustomError(CROSS_FIELD_ERROR, "{problems}", {"problems": "; ".join(problems)})
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
        gpus = all(gpus_per_pod(self.template_of(m)) > 0 for m in self.world(world).ranks)
        return "nccl" if gpus else "gloo"

    def local_backend_of(self, world: str, cuda_available: bool) -> tuple[Backend, str | None]:
        choice = self.world(world).backend or self.spec.backend
        if choice == "auto":
            return ("nccl" if cuda_available else "gloo"), None
        if choice == "nccl" and not cuda_available:
            return "gloo", f"world {world!r}: backend nccl needs CUDA, which is not available here; using gloo"
        return choice, None


def gpus_per_pod(template: Mapping[str, Any]) -> int:
    """How many `nvidia.com/gpu` a pod of this PodTemplateSpec asks for: its containers' limits
    or requests, whichever is more, added up (a quantity that is not a whole number counts 0)."""
    total = 0
    containers = get(get(template, "spec"), "containers")
    for container in containers if isinstance(containers, list) else []:
        resources = get(container, "resources")
        total += max(_whole(get(get(resources, kind), GPU_RESOURCE)) for kind in ("limits", "requests"))
    return total


def _whole(value: object) -> int:
    try:
        amount = float(str(value))
    except ValueError:
        return 0
    return int(amount) if amount > 0 and amount.is_integer() else 0
