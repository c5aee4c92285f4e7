"""The largest MultiWorld the spec accepts, with the longest names it allows, and what the
operator and its workers write for it, each built by the real code (pure: no cluster, no mocks).
tests/spec/test_limits.py holds each figure to its limit; bench/scale.py reports them.

The limits, as Linux and Kubernetes set them:
- ENV_STRING_LIMIT: one `NAME=value` string of a process's environment, its NUL included
  (Linux's MAX_ARG_STRLEN, 32 pages: execve refuses a longer one with E2BIG, so the container
  cannot start). `exec_string_limit()` measures it on this machine.
- ANNOTATIONS_LIMIT: an object's annotations, keys and values together (the API server refuses
  a write beyond it).
- OBJECT_LIMIT: one object as etcd stores it (its default request limit); the MultiWorld holds
  its spec, its metadata and its status in one object.
- CONFIGMAP_LIMIT: a ConfigMap's data and binaryData together (the planner's memory).
- MAX_LINE: one message a worker sends the operator over the worker channel (the operator's
  channel server reads no longer line).
- The chart's memory limit for the operator (charts/multiworld-operator/values.yaml), and one
  second for a plan.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml

from multiworld.contract import ENV_WORLDS, BrokenWorldReport, ChannelMessage, WorkerStatus, WorldAssignment
from multiworld_operator.channel_server import MAX_LINE as MAX_LINE
from multiworld_operator.kube.memory.planner_memory import json_values, memory_body
from multiworld_operator.kube.objects.bodies import pod_body, rendezvous_host
from multiworld_operator.kube.objects.ports import world_ports
from multiworld_operator.planner import CreatePod, MultiWorldStatus, Plan, plan
from multiworld_operator.planner.status import MAX_MESSAGE, RECENT_RESTARTS, RESTART_SLOTS, RestartSlot
from multiworld_operator.spec import MultiWorld, parse_manifest
from multiworld_operator.spec.limits import (
    MAX_PODS,
    MAX_RANKS,
    MAX_RESTARTS,
    MAX_SPARES,
    MAX_SPEC_BYTES,
    MAX_WORLDS,
    MAX_WORLDS_PER_POD,
    PORT_BASE,
    PORT_SPAN,
)
from multiworld_operator.spec.names import MAX_LABEL, SPARE_SERIAL_ROOM
from multiworld_operator.world_secrets import KEY_BYTES, WorldSecrets
from tests.support.planner_sim import Sim

REPO = Path(__file__).resolve().parents[2]
M = TypeVar("M")
KIB, MIB = 1 << 10, 1 << 20
ENV_STRING_LIMIT = 128 * KIB
ANNOTATIONS_LIMIT = 256 * KIB
OBJECT_LIMIT = 1536 * KIB
CONFIGMAP_LIMIT = 1 * MIB
PLAN_LIMIT_S = 1.0
# The rest of a MultiWorld's metadata beside its annotations (managedFields: well under a KiB
# as bench/scale.py measures it, the lists being atomic; names, labels, finalizers), and so what
# the object leaves its status beside a spec at its cap and annotations at their limit.
METADATA_ROOM = 32 * KIB
STATUS_ROOM = OBJECT_LIMIT - MAX_SPEC_BYTES - ANNOTATIONS_LIMIT - METADATA_ROOM
CHART_VALUES = REPO / "charts" / "multiworld-operator" / "values.yaml"

# The worst case of each number the objects below carry: an epoch of ten digits (a restart a
# second for 68 years), and ranks and sizes of as many digits as the largest world has.
EPOCH = 2**31 - 1
PORT = PORT_BASE + PORT_SPAN - 1
# What the pods are told of the operator (its address as long as a Service's name may be).
CHANNEL_URL = f"operator://{'o' * 63}.{'n' * 63}.svc.cluster.local:65535"
RANK = MAX_RANKS - 1
WHEN = datetime(2024, 5, 1, 12, 0, 0, 999_999, tzinfo=UTC)
# The reason of a worker's report, taken at MAX_MESSAGE characters as the spec's caps assume
# (the worker does not cut it: a join that failed quotes its exception whole).
REASON = MAX_MESSAGE
# The longest termination message the kubelet keeps: the status cuts a failure's quote of it.
TERMINATION_MESSAGE = 4096
# A name of each kind at its longest; the MultiWorld's is as long as a pod name of a
# one-letter member with ordinal 0 allows (the host a worker rendezvouses with is
# `<rank-0 pod>.<MultiWorld>`).
MW_NAME = "m" * (MAX_LABEL - len("-a-0"))
NAMESPACE = "n" * MAX_LABEL
OWNER = {"metadata": {"name": MW_NAME, "namespace": NAMESPACE, "uid": "u" * 36}}


def longest_names(prefix: str, count: int, length: int = MAX_LABEL) -> list[str]:
    """`count` distinct DNS labels of exactly `length` characters."""
    width = len(str(count - 1))
    return [f"{prefix}{i:0{width}d}".ljust(length, "x") for i in range(count)]


# Every world's secret at its epoch, as the operator puts it in a pod's env (world_secrets.py).
SECRETS = WorldSecrets(bytes(KEY_BYTES), "ns/mw/uid")


# -- one pod in many worlds ------------------------------------------------------------------


def pod_in_worlds(worlds: int) -> tuple[str, list[WorldAssignment]]:
    """A pod with a name of 63 characters in `worlds` worlds, every field of its assignments at
    its longest: world names of 63 characters, the host of the longest names, ten-digit epochs."""
    pod = f"{MW_NAME}-a-0"
    host = rendezvous_host(MW_NAME, pod)
    assignments = [
        WorldAssignment(name=name, rank=RANK, size=RANK + 1, host=host, port=PORT, epoch=EPOCH, backend="nccl")
        for name in longest_names("w", worlds)
    ]
    return pod, assignments


def pod_of(worlds: int) -> dict[str, Any]:
    """The Pod the operator creates for `pod_in_worlds(worlds)` (kube.bodies.pod_body)."""
    pod, assignments = pod_in_worlds(worlds)
    create = CreatePod(
        pod=pod,
        member="a",
        ordinal=0,
        created_for={a.name: a.epoch for a in assignments},
        worlds=assignments,
        template=_TEMPLATE,
    )
    return pod_body(SECRETS.create(create), OWNER, CHANNEL_URL)


def env_string(worlds: int) -> bytes:
    """The `MULTIWORLD_WORLDS=...` string of that pod (worlds_env)."""
    return worlds_env(pod_of(worlds))


def worlds_env(pod: dict[str, Any]) -> bytes:
    """The `MULTIWORLD_WORLDS=...` string of a pod body's container as execve sees it: UTF-8,
    NUL-terminated."""
    (container,) = pod["spec"]["containers"]
    (value,) = [e["value"] for e in container["env"] if e["name"] == ENV_WORLDS]
    return f"{ENV_WORLDS}={value}".encode() + b"\0"


def pod_annotations(worlds: int) -> dict[str, str]:
    """Every annotation of that pod: the operator's created-for stamp (its worker writes none)."""
    return dict(pod_of(worlds)["metadata"]["annotations"])


def worker_line(worlds: int) -> int:
    """The longest message that pod's worker sends (multiworld.channels.stream), in bytes: its
    WorkerStatus holding every world in every map (joined at one epoch, joining the next, errors
    seen), or a broken-world report with a reason of REASON characters."""
    pod, assignments = pod_in_worlds(worlds)
    names = [a.name for a in assignments]
    status = WorkerStatus(
        pod=pod,
        joined=dict.fromkeys(names, EPOCH),
        joining=dict.fromkeys(names, EPOCH),
        errors=dict.fromkeys(names, 2**31 - 1),
        started=WHEN,
        joined_at=dict.fromkeys(names, WHEN),
        waiting=False,
        plays=pod,
    )
    report = BrokenWorldReport(world=names[0], epoch=EPOCH, reason="r" * REASON, peer_rank=RANK, pod=pod, time=WHEN)
    return max(len(ChannelMessage(status=status).encode()), len(ChannelMessage(report=report).encode()))


def annotations_bytes(annotations: dict[str, str]) -> int:
    """Their size as the API server counts it: every key and value, in bytes."""
    return sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())


def exec_string_limit() -> int:
    """The longest environment string (NUL included) execve accepts here, found by running
    /bin/true with ever longer ones (bisection)."""
    fits, refused = 2, 64 * MIB

    def starts(length: int) -> bool:
        try:
            subprocess.run(["true"], env={"X": "x" * (length - 3)}, check=True)  # "X=" and the NUL
        except OSError:  # E2BIG: Argument list too long
            return False
        return True

    while refused - fits > 1:
        middle = (fits + refused) // 2
        fits, refused = (middle, refused) if starts(middle) else (fits, middle)
    return fits


# -- the largest spec ------------------------------------------------------------------------


def largest_manifest(
    pods: int = MAX_PODS, ranks: int = MAX_RANKS, worlds: int = MAX_WORLDS, per_pod: int = MAX_WORLDS_PER_POD
) -> dict[str, Any]:
    """A MultiWorld at every count cap at once: `worlds` worlds of 63-character names, hub pods
    each in `per_pod` of them (rank 0), every other pod in one world, `ranks` ranks (the first
    world holds what the others leave: it is as large as they allow) and `pods` pods (warm
    spares make up what the ranks leave), pod names of 63 characters, every world with a
    failure policy of its own (restarts at once)."""
    mw = "m" * 40
    hubs = -(-worlds // per_pod)
    extra = ranks - 2 * worlds  # ranks beyond one hub and one worker per world
    spares = pods - hubs - (ranks - worlds)
    if extra < 0 or spares < 0 or spares > MAX_SPARES * worlds:
        raise ValueError("the caps leave no spec that reaches them all")
    hub_names = longest_names("h", hubs, MAX_LABEL - len(mw) - len("--0"))
    members: list[dict[str, Any]] = [{"name": h} for h in hub_names]
    world_specs: list[dict[str, Any]] = []
    replicas = [1 + extra] + [1] * (worlds - 1)  # one world as large as the others leave
    spare_counts = _spread(spares, worlds)
    for i, world in enumerate(longest_names("w", worlds)):
        ordinals = len(str(replicas[i] - 1))
        serials = len("spare-") + SPARE_SERIAL_ROOM if spare_counts[i] else 0
        room = MAX_LABEL - len(mw) - 2 - max(ordinals, serials)  # the longest pod or spare name: 63
        worker = f"p{i:04d}".ljust(room, "x")
        members.append({"name": worker, "replicas": replicas[i], "spares": spare_counts[i]})
        world_specs.append({"name": world, "ranks": [hub_names[i // per_pod], worker], "failurePolicy": _POLICY})
    return {
        "apiVersion": "multiworld.io/v1alpha1",
        "kind": "MultiWorld",
        "metadata": {"name": mw, "namespace": NAMESPACE, "uid": "u" * 36, "generation": 1},
        "spec": {"template": copy.deepcopy(_TEMPLATE), "members": members, "worlds": world_specs},
    }


_TEMPLATE = {"spec": {"containers": [{"name": "worker", "image": "x"}]}}
_POLICY = {"maxRestarts": 10_000, "window": "366d", "joinTimeout": "366d", "backoff": {"maxDelay": "0s"}}


def _spread(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


# -- the planner at the largest spec ---------------------------------------------------------


class Platform(Sim):
    """tests/support/planner_sim.py's platform, planning as the operator plans (reconcile.py:
    each world's port, and `<rank-0 pod>.<MultiWorld>` to rendezvous with)."""

    def plan(self) -> Plan:
        ports = world_ports(self.mw, self.status.table if self.status else None)
        self.last = plan(
            self.mw,
            self.status,
            self.observation(),
            endpoint=lambda world, rank0: (rendezvous_host(self.mw.name, rank0), ports[world]),
        )
        return self.last

    def fail_with(self, pods: list[str], message: str) -> None:
        """These pods end, each saying `message` (its termination message)."""
        for pod in pods:
            self.pods[pod] = self.pods[pod].model_copy(update={"phase": "Failed", "message": message})

    def waiting(self, reason: str) -> None:
        """Every pod not running yet waits for `reason` (an unschedulable pod's condition)."""
        for name, pod in self.pods.items():
            if pod.phase == "Pending":
                self.pods[name] = pod.model_copy(update={"waiting": reason})


@dataclass(frozen=True)
class Clocked:
    """One plan() call: the wall clock and this thread's CPU time, from just before the call
    until it returns."""

    wall_s: float
    cpu_s: float


def clocked(call: Callable[[], Plan]) -> tuple[Plan, Clocked]:
    wall, cpu = time.perf_counter(), time.thread_time()
    result = call()
    return result, Clocked(time.perf_counter() - wall, time.thread_time() - cpu)


def traced(call: Callable[[], Plan]) -> tuple[Plan, float]:
    """One plan() call and the most memory Python held for it meanwhile, in MiB (tracemalloc:
    what it allocated and had not freed at its peak, the plan it returns included)."""
    tracemalloc.start()
    try:
        result = call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, peak / MIB


def two_plans(platform: Platform, measure: Callable[[Callable[[], Plan]], tuple[Plan, M]]) -> Iterator[tuple[Plan, M]]:
    """The two plan() calls that matter, each made by `measure`, with what it says of it: the
    first observation (nothing exists yet), then, once every pod runs, the failure of the pod
    in most worlds (a termination message of TERMINATION_MESSAGE characters). Each plan is applied."""
    first = measure(platform.plan)
    yield first
    platform.execute(first[0])
    platform.settle()
    platform.fail_with([hub_of(platform.mw)], "f" * TERMINATION_MESSAGE)
    failure = measure(platform.plan)
    yield failure
    platform.execute(failure[0])


def hub_of(multiworld: MultiWorld) -> str:
    """The pod in most worlds."""
    return max(multiworld.all_pods(), key=lambda pod: len(multiworld.worlds_of_pod(pod)))


@dataclass(frozen=True)
class Largest:
    """The figures of the largest accepted spec: its counts, its two plans, and the size of
    every object written for it (bytes)."""

    pods: int
    ranks: int
    worlds: int
    worlds_per_pod: int
    spec_bytes: int
    plan_first: Clocked
    plan_failure: Clocked
    # The CR's status (the planner's view) after the first plan, and at its largest.
    status_first_bytes: int
    status_worst_bytes: int
    # The planner's memory ConfigMap (whole, and its data), and the memory in it decompressed
    # (bytes, and JSON values as kube.planner_memory counts them).
    memory_configmap_bytes: int
    memory_configmap_data_bytes: int
    memory_bytes: int
    memory_values: int
    # The pod in most worlds: its MULTIWORLD_WORLDS string (the operator's pod body for it),
    # every annotation of it (pod_annotations) and its worker's longest message (worker_line).
    env_string_bytes: int
    annotations_bytes: int
    worker_line_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_largest(manifest: dict[str, Any] | None = None) -> Largest:
    """The largest spec planned as the operator meets it (two_plans, each clocked), and then
    the status at its largest: every pod failed with a termination message of TERMINATION_MESSAGE
    characters (cut by the status), every replacement waiting with a reason of MAX_MESSAGE."""
    data = manifest or largest_manifest()
    multiworld = parse_manifest(data)
    platform = Platform(multiworld)
    (first, plan_first), (failure, plan_failure) = two_plans(platform, clocked)
    hub = hub_of(multiworld)
    (hub_create,) = [c for c in first.creates if c.pod == hub]
    platform.settle()
    platform.fail_with(list(platform.pods), "f" * TERMINATION_MESSAGE)
    platform.step()  # the failed pods go
    platform.step()  # their replacements come
    platform.waiting("w" * MAX_MESSAGE)
    worst = platform.plan()
    raw = json.dumps(with_full_histories(worst.status).to_dict(), separators=(",", ":")).encode()
    memory = memory_body(data, json.loads(raw))
    return Largest(
        pods=len(multiworld.all_pods()) + sum(m.spares for m in multiworld.spec.members),
        ranks=sum(len(multiworld.world_pods(w.name)) for w in multiworld.spec.worlds),
        worlds=len(multiworld.spec.worlds),
        worlds_per_pod=len(multiworld.worlds_of_pod(hub)),
        spec_bytes=_json_bytes(data["spec"]),
        plan_first=plan_first,
        plan_failure=plan_failure,
        status_first_bytes=_json_bytes(first.status.view()),
        status_worst_bytes=max(_json_bytes(p.status.view()) for p in (first, failure, worst)),
        memory_configmap_bytes=_json_bytes(memory),
        memory_configmap_data_bytes=sum(len(v) for v in memory["binaryData"].values()),
        memory_bytes=len(raw),
        memory_values=json_values(raw),
        env_string_bytes=len(worlds_env(pod_body(SECRETS.create(hub_create), data, CHANNEL_URL))),
        annotations_bytes=annotations_bytes(pod_annotations(len(multiworld.worlds_of_pod(hub)))),
        worker_line_bytes=worker_line(len(multiworld.worlds_of_pod(hub))),
    )


def with_full_histories(status: MultiWorldStatus) -> MultiWorldStatus:
    """`status` with every world's restart history as long as it grows: RECENT_RESTARTS restarts
    one by one, 2 * RESTART_SLOTS slots of MAX_RESTARTS."""
    recent = [WHEN] * RECENT_RESTARTS
    slots = [RestartSlot(last=WHEN, count=MAX_RESTARTS)] * (2 * RESTART_SLOTS)
    worlds = {
        name: world.model_copy(update={"recent_restarts": recent, "earlier_restarts": slots})
        for name, world in status.worlds.items()
    }
    return status.model_copy(update={"worlds": worlds})


def plan_peak_mib(manifest: dict[str, Any] | None = None) -> float:
    """The larger tracemalloc peak of the two plans (`traced`)."""
    platform = Platform(parse_manifest(manifest or largest_manifest()))
    return max(peak for _, peak in two_plans(platform, traced))


def operator_rss_mib() -> float:
    """The peak resident memory (VmHWM) of a process that imports the operator as
    `multiworld operator` runs it (kopf, the Kubernetes client) and makes the two plans of the
    largest spec: a fresh interpreter, so nothing else of this one counts."""
    code = "from tests.support import limits_support; limits_support._rss()"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO).stdout
    return float(out.split()[-1])


def _rss() -> None:
    import multiworld_operator.kube.main  # noqa: F401  # what the operator's process holds before any MultiWorld

    for _ in two_plans(Platform(parse_manifest(largest_manifest())), lambda call: (call(), None)):
        pass
    (line,) = [x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:")]
    print(int(line.split()[1]) / 1024)


def chart_memory_limit_mib() -> float:
    """resources.limits.memory of the operator in the chart's values (a quantity in Mi or Gi)."""
    quantity = str(yaml.safe_load(CHART_VALUES.read_text())["resources"]["limits"]["memory"])
    found = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    if found is None:
        raise ValueError(f"{CHART_VALUES}: resources.limits.memory {quantity!r} is not in Mi or Gi")
    return int(found[1]) * (1024 if found[2] == "Gi" else 1)


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())
