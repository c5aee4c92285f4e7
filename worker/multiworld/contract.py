"""The worker <-> controller contract: what a process is told and what it reports.

Shared by the worker runtime and both platforms (the Kubernetes operator and the local
runner). Deliberately free of torch and kubernetes imports so the operator image can use it.

- At start a process reads `WorkerEnv` from its environment: its own pod name, the worlds it
  is in (`WorldAssignment`s) and where live world-table updates come from.
- Later a platform publishes a `WorldTable` (every world with its epoch and its pods in rank
  order); each process derives its own assignments from it with `assignments_for(pod)`.
- A process that sees a world break sends a `BrokenWorldReport`.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator, model_validator

Backend = Literal["gloo", "nccl"]

# Environment variable names (the env half of the contract).
ENV_POD = "MULTIWORLD_POD"
ENV_WORLDS = "MULTIWORLD_WORLDS"
ENV_TABLE = "MULTIWORLD_TABLE"
ENV_NAME = "MULTIWORLD_NAME"
ENV_NAMESPACE = "MULTIWORLD_NAMESPACE"
# Set (to its member's name) in a warm spare: a process that waits for an identity.
ENV_SPARE = "MULTIWORLD_SPARE"
# Set by the user (the platforms set no port): where the worker serves its Prometheus metrics.
ENV_METRICS_PORT = "MULTIWORLD_METRICS_PORT"

# Where a worker on Kubernetes proves which pod it is: a projected ServiceAccount token bound to
# its pod, of this audience, at this path (ENV_TOKEN_FILE overrides the path). The operator
# checks it with a TokenReview once per connection of the channel.
TOKEN_AUDIENCE = "multiworld.io"
TOKEN_PATH = "/var/run/secrets/multiworld.io/token"
ENV_TOKEN_FILE = "MULTIWORLD_TOKEN_FILE"

# The label of every object the operator makes for a MultiWorld (its pods, Service, memory).
NAME_LABEL = "multiworld.io/name"


def event_name(involved: str) -> str:
    """A unique name for an Event about `involved`, as client-go makes them (the object's name
    and the time in hex): generateName's five random characters collide within a few thousand
    Events, and the API server then refuses the create."""
    return f"{involved}.{time.time_ns():x}{next(_EVENT_SEQUENCE):x}"


_EVENT_SEQUENCE = itertools.count()

# World names double as store key prefixes and DNS-ish labels.
WORLD_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


# A world's secret at one epoch (`WorldAssignment.secret`): 32 to 64 lowercase hex digits,
# or "" where no controller hands secrets (pymultiworld's `initialize_world`, a hand-made env).
SECRET_PATTERN = r"^([0-9a-f]{32,64})?$"


def store_prefix(world: str, epoch: int, secret: str = "") -> str:
    """Where the store keys of one incarnation of a world live, fencing out older epochs. With
    the epoch's secret in it, a process that was not handed the secret (one that holds no rank in
    the world at this epoch) cannot name, and so neither read nor write, any key under it."""
    return f"{world}/{epoch}/{secret}/" if secret else f"{world}/{epoch}/"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorldAssignment(_Model):
    """One world as seen by one process: where to rendezvous and which rank it holds."""

    name: str = Field(min_length=1, max_length=63)
    rank: int = Field(ge=0)
    size: int = Field(ge=2)
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    epoch: int = Field(default=1, ge=1)
    backend: Backend = "gloo"
    # The world's secret at this epoch, handed by the controller to this epoch's members only
    # (over the authenticated channel, and in the pod's env at start): every store key of the
    # epoch lives under it (`store_prefix`), and the world-wide epoch key is not used. "" where
    # no controller hands secrets: keys under `<world>/<epoch>/`, open to anyone who reaches the
    # store (pymultiworld's `initialize_world`, a hand-made MULTIWORLD_WORLDS).
    secret: str = Field(default="", pattern=SECRET_PATTERN, repr=False)

    @field_validator("name")
    @classmethod
    def _name_is_label(cls, value: str) -> str:
        if not WORLD_NAME_RE.match(value):
            raise ValueError(f"world name {value!r} must be a DNS label (a-z, 0-9, '-')")
        return value

    @model_validator(mode="after")
    def _rank_in_range(self) -> WorldAssignment:
        if self.rank >= self.size:
            raise ValueError(f"rank {self.rank} is out of range for size {self.size}")
        return self

    @property
    def store_prefix(self) -> str:
        """Store keys of this incarnation live here, fencing out older epochs."""
        return store_prefix(self.name, self.epoch, self.secret)


class WorldEntry(_Model):
    """One world in the live table: its epoch and its pods in rank order."""

    name: str
    epoch: int = Field(ge=1)
    backend: Backend = "gloo"
    host: str
    port: int = Field(ge=1, le=65535)
    pods: list[str] = Field(min_length=2)
    # Pod -> the epoch of this world its current instance was created for. On Kubernetes a
    # replaced instance still runs for a moment after its Pod is gone; this keeps it from taking
    # its pod's rank at the new epoch, which belongs to the new instance.
    instances: dict[str, int] = Field(default_factory=dict)
    # A warm spare keeps its own pod name: spare pod -> the member pod (`<mw>-<member>-<ordinal>`)
    # it plays, for each spare among `pods`.
    plays: dict[str, str] = Field(default_factory=dict)
    # The world's secret at this epoch (WorldAssignment.secret): the platform fills it in as it
    # sends each pod its entries (the planner's table has none).
    secret: str = Field(default="", pattern=SECRET_PATTERN, repr=False)

    @property
    def size(self) -> int:
        return len(self.pods)

    def assignment(self, pod: str) -> WorldAssignment:
        return WorldAssignment(
            name=self.name,
            rank=self.pods.index(pod),
            size=self.size,
            host=self.host,
            port=self.port,
            epoch=self.epoch,
            backend=self.backend,
            secret=self.secret,
        )


class WorldTable(_Model):
    """Every world of one MultiWorld at one moment; `revision` only grows."""

    revision: int = Field(default=0, ge=0)
    worlds: list[WorldEntry] = Field(default_factory=list)

    def for_pod(self, pod: str) -> WorldTable:
        """The entries that name `pod`: all that pod's worker needs."""
        return WorldTable(revision=self.revision, worlds=[w for w in self.worlds if pod in w.pods])

    def assignments_for(self, pod: str) -> dict[str, WorldAssignment]:
        return {w.name: w.assignment(pod) for w in self.worlds if pod in w.pods}

    def plays(self, pod: str) -> str:
        """The member pod that `pod` plays: itself, unless it is a warm spare given an identity."""
        return next((w.plays[pod] for w in self.worlds if pod in w.plays), pod)

    def replaced(self, pod: str, created_for: Mapping[str, int]) -> list[str]:
        """The worlds whose entry names a newer instance of `pod` than the one created for the
        epochs `created_for` (world -> epoch): that instance has been replaced."""
        return [
            w.name
            for w in self.worlds
            if w.name in created_for and w.instances.get(pod, created_for[w.name]) > created_for[w.name]
        ]


class WorkerEnv(_Model):
    """What a process starts with, read from (and written to) its environment."""

    pod: str
    worlds: list[WorldAssignment] = Field(default_factory=list)
    # Where live table updates come from: "" (none: the start-up worlds are final),
    # "local://HOST:PORT" (the local runner), "operator://HOST:PORT" (the operator).
    table: str = ""
    # A warm spare of this member: no worlds at start; `init_from_env` waits until the live
    # table gives this pod an identity.
    spare: str = ""
    # Where the worker serves its metrics (multiworld.metrics); None: it serves none.
    metrics_port: int | None = Field(default=None, ge=1, le=65535)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WorkerEnv:
        missing = [k for k in (ENV_POD, ENV_WORLDS) if k not in environ]
        if missing:
            raise ValueError(
                f"missing environment variable(s): {', '.join(missing)}: the platform sets them in a member's "
                "process, so run this program as a member's command (`multiworld run FILE.yaml` on this "
                "machine, or a MultiWorld on Kubernetes)"
            )
        try:
            worlds = json.loads(environ[ENV_WORLDS])
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV_WORLDS} is not valid JSON: {exc}") from exc
        return cls(
            pod=environ[ENV_POD],
            worlds=worlds,
            table=environ.get(ENV_TABLE, ""),
            spare=environ.get(ENV_SPARE, ""),
            metrics_port=metrics_port_from_env(environ),
        )

    @model_validator(mode="after")
    def _spare_waits_for_a_table(self) -> WorkerEnv:
        if self.spare and (self.worlds or not self.table):
            raise ValueError(f"{ENV_SPARE}: a spare starts with no worlds and a live table ({ENV_TABLE})")
        return self

    def to_env(self) -> dict[str, str]:
        env = {
            ENV_POD: self.pod,
            ENV_WORLDS: json.dumps([_env_world(w) for w in self.worlds], separators=(",", ":")),
            ENV_TABLE: self.table,
        }
        if self.spare:
            env[ENV_SPARE] = self.spare
        if self.metrics_port is not None:
            env[ENV_METRICS_PORT] = str(self.metrics_port)
        return env


def _env_world(world: WorldAssignment) -> dict[str, object]:
    """An assignment as MULTIWORLD_WORLDS lists it: its secret only where it has one."""
    return world.model_dump(exclude=None if world.secret else {"secret"})


def metrics_port_from_env(environ: Mapping[str, str]) -> int | None:
    """MULTIWORLD_METRICS_PORT, checked: None when unset or empty."""
    raw = environ.get(ENV_METRICS_PORT, "").strip()
    if not raw:
        return None
    port = int(raw) if raw.isdecimal() else 0
    if not 1 <= port <= 65535:
        raise ValueError(f"{ENV_METRICS_PORT}={raw!r} is not a port: an integer from 1 to 65535")
    return port


def _now() -> datetime:
    return datetime.now(UTC)


# How a report of a join that timed out or was refused begins (BrokenWorldReport.reason).
JOIN_FAILED = "join failed: "


class BrokenWorldReport(_Model):
    """A process's verdict that one world (at one epoch) is broken."""

    world: str
    epoch: int = Field(ge=1)
    reason: str
    peer_rank: int | None = None
    pod: str = ""
    # Times carry their zone: the platform compares them with its own (and each other).
    time: AwareDatetime = Field(default_factory=_now)
    # The member pod a warm spare plays, when `pod` is one ("" otherwise).
    plays: str = ""


class WorkerStatus(_Model):
    """What a process currently holds: the epoch it joined per world, and the errors its code
    saw per world. Sent on every change so a platform can tell when a world is whole again."""

    pod: str
    joined: dict[str, int] = Field(default_factory=dict)
    # The epoch it is joining per world (its rendezvous under way): a live process that follows
    # the table, while the other members come.
    joining: dict[str, int] = Field(default_factory=dict)
    errors: dict[str, int] = Field(default_factory=dict)
    # The process's own clock: when its program was ready (its imports done) and when it joined
    # each world it holds, so that a recovery's time can be split at the worker's side; with
    # their zone, as every time on the channel.
    started: AwareDatetime | None = None
    joined_at: dict[str, AwareDatetime] = Field(default_factory=dict)
    # A warm spare: `waiting` while it waits for an identity (its program is ready), then the
    # member pod it `plays`.
    waiting: bool = False
    plays: str = ""


class Hello(_Model):
    """The first message on every connection: which pod speaks, and (on Kubernetes) its token."""

    pod: str = Field(min_length=1)
    token: str = ""


class ChannelMessage(_Model):
    """One line on a channel (newline-delimited JSON): exactly one field is set.

    Worker -> platform: `hello` (first), `report`, `status`.
    Platform -> worker: `table`, or `refused` (why the platform closes this connection).
    """

    hello: Hello | None = None
    report: BrokenWorldReport | None = None
    status: WorkerStatus | None = None
    table: WorldTable | None = None
    refused: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ChannelMessage:
        fields = ("hello", "report", "status", "table", "refused")
        set_fields = [k for k in fields if getattr(self, k) is not None]
        if len(set_fields) != 1:
            raise ValueError(f"a channel message carries exactly one field, got {set_fields or 'none'}")
        return self

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes | str) -> ChannelMessage:
        return cls.model_validate_json(line)
