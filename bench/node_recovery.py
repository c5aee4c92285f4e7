"""Recovery on a real node: a world1 worker of the all_gather example killed through the
container runtime, until world1 runs again, under each recovery rule (`failurePolicy.replace:
Pod`, the default, with new pods and with one warm spare; `replace: World`) and for world1 of 2,
3 (the example as committed) and 8 members; beside them, the single_world example's whole-group
restart (what LeaderWorkerSet and JobSet do by default) and what the unaffected world saw.

Runs against a cluster with a node: its own, started in a temp dir (tests/cluster/cluster.py,
images from tests/cluster/images.py, the chart with the operator image), or a running one given
with --cluster (`make cluster`'s .cluster, or a test session's).

Scenarios. world1 of N members is the leader and N-1 pods of w1 (examples/all_gather with w1's
replicas set to N-1; world2, the leader and two w2 pods, as committed). For each N (2 and 3 with
--quick; 2, 3 and 8 without) one MultiWorld runs three scenarios in turn, each with --kills
kills, the manifest edited (kubectl apply) between them and the next kill only once the operator
has seen the edit (status.observedGeneration):
- new_pods: `replace: Pod`, no spare: the killed pod is replaced by a new pod, the others keep
  theirs and join the new epoch.
- replace_world: `replace: World`: every pod of world1 in no other healthy world is replaced by
  a new pod (its N-1 w1 pods; the leader stays, world2 being healthy).
- one_spare: `replace: Pod` with one warm spare of w1 (`spares: 1`): each kill waits until the
  spare is ready (its worker waiting for an identity) and every pod up; the spare plays the
  killed pod.
Each kill takes the next w1 pod, from the last down (the pod that plays it now: a spare, after
a spare took its place), after the previous recovery completed; the first restart has no backoff
(`initialDelay: 0s`), nor has any later one (a delay of 0s grows to 0s).

Clocks (wall time; the node, the workers and this process share the machine's clock):
- every recovery time starts just before the SIGKILL is sent to the container (containerd's
  `tasks kill`) and stops at world1's `formedAt` at the kill's epoch + 1: the moment its last
  rank joined that epoch, by that worker's own clock, as the workers told the operator over the
  worker channel and the MultiWorld's status shows it.
- node_recovery_s, spare_recovery_s, world_restart_s: N=3's new_pods, one_spare and
  replace_world (the same runs as sizes["3"]).
- breakdown_s, over N=3's new_pods kills, for the new pod that joined last: operator = kill ->
  its replacement Pod seen by a watch; schedule = -> the Pod seen bound to the node;
  container_start = -> the container's process started (its start time in /proc); ready = ->
  the end of the recovery (the program's imports and its rendezvous).
- whole_restart_s: the same clock for single_world (one plain torch world of 3 ranks, its
  manifest as committed, `replace: World`: a plain program cannot join a new epoch), where
  every pod of the world is replaced.
- replaced per kill: world1's ranks (single_world's, for whole_restart_s) whose holder changed
  from the table entry before the kill to the one of the new epoch: a pod of another uid
  (a new pod of the same name) or another pod (a warm spare that now plays it). A kill under
  `replace: Pod` should cost 1, under `replace: World` N-1, and single_world's 3.
- unaffected (N=3, over its three scenarios): restarts = world2's restarts in the MultiWorld's
  status after that MultiWorld's whole run; worst_gap_ratio = the longest gap between world2's
  steps (w2-0's log, kubelet timestamps) while world1 recovered, over the median gap.

JSON (--json, the last line): node_recovery_s, spare_recovery_s, world_restart_s and
whole_restart_s as {min, median, max}; replaced_per_kill: for each of those four, the count of
each kill in order; sizes: {"<N>": {"new_pods" | "one_spare" | "replace_world": {"recovery_s":
{min, median, max}, "replaced_per_kill": [count, ...]}}}; breakdown_s: {stage: median seconds};
unaffected: {restarts, worst_gap_ratio}.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from multiworld.contract import WorldEntry
from multiworld_operator.kube.memory.planner_memory import read_memory
from tests.cluster import cluster as cluster_module
from tests.support import bench_common as common, node_support as support

T = TypeVar("T")

STAGES = ("operator", "schedule", "container_start", "ready")
INTERVAL_S = 0.5
WAIT_S = 300.0
# Members of world1 (the leader and N-1 w1 pods): the node has 2 cores, so 8 only without --quick.
SIZES = (2, 3, 8)
QUICK_SIZES = (2, 3)
# The example as committed: its figures are the top-level ones, and world2 is watched there.
EXAMPLE_SIZE = 3


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    replace: str
    spares: int


# In the order each MultiWorld runs them (spares last: the pool then stays to the end).
SCENARIOS = (
    Scenario("new_pods", "replace: Pod, new pods", "Pod", 0),
    Scenario("replace_world", "replace: World", "World", 0),
    Scenario("one_spare", "replace: Pod, one warm spare", "Pod", 1),
)
# The top-level JSON figure of each scenario (of N=3).
TOP_LEVEL = {"new_pods": "node_recovery_s", "one_spare": "spare_recovery_s", "replace_world": "world_restart_s"}


def parse_args(argv: list[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.setting("--kills", int, 5, 1, "kills per scenario")
    p.add_argument("--cluster", type=Path, help="a running cluster's folder (with a node) instead of a new one")
    args = p.parse_args(argv)
    args.sizes = QUICK_SIZES if args.quick else SIZES
    return args


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = WAIT_S) -> T:
    return cluster_module.wait_for(what, probe, timeout)


@dataclass
class PodTimes:
    """When this process's watch first saw a pod instance, and saw it bound to the node."""

    seen: dict[str, float] = field(default_factory=dict)
    scheduled: dict[str, float] = field(default_factory=dict)


@contextmanager
def watching_pods(core: client.CoreV1Api, namespace: str) -> Iterator[PodTimes]:
    times = PodTimes()
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            for event in watch.Watch().stream(core.list_namespaced_pod, namespace, timeout_seconds=5):
                now = time.time()
                pod = event["object"]
                times.seen.setdefault(pod.metadata.uid, now)
                if pod.spec.node_name:
                    times.scheduled.setdefault(pod.metadata.uid, now)
                if stop.is_set():
                    return

    thread = threading.Thread(target=run, name="pod watch", daemon=True)
    thread.start()
    try:
        yield times
    finally:
        stop.set()
        thread.join(10)


def _meta(pod: client.V1Pod) -> client.V1ObjectMeta:
    """A served pod's metadata (the API server always sends it)."""
    assert pod.metadata is not None
    return pod.metadata


def _uid(pod: client.V1Pod) -> str:
    uid = _meta(pod).uid
    assert uid is not None
    return uid


def pods_of(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, client.V1Pod]:
    """The MultiWorld's pods not being deleted, by name."""
    pods = core.list_namespaced_pod(namespace, label_selector=f"multiworld.io/name={name}").items
    return {_meta(p).name or "": p for p in pods if _meta(p).deletion_timestamp is None}


def world_status(core: client.CoreV1Api, namespace: str, name: str, world: str) -> dict[str, Any]:
    status = multiworld(core.api_client, namespace, name).get("status") or {}
    shown: dict[str, Any] = (status.get("worlds") or {}).get(world) or {}
    return shown


def process_start(cluster: Any, pod: client.V1Pod) -> float:
    """Wall-clock start of the container's process: its /proc start time (in clock ticks since
    boot), placed on the wall clock through CLOCK_BOOTTIME."""
    container = support.container_id(pod)
    assert pod.spec is not None
    for line in cluster.node_named(pod.spec.node_name).ctr(["tasks", "ls"], "listing tasks").splitlines()[1:]:
        words = line.split()
        if words and words[0] == container:
            ticks = int(Path(f"/proc/{words[1]}/stat").read_text().rsplit(")", 1)[1].split()[19])
            since_boot = ticks / os.sysconf("SC_CLK_TCK")
            return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    raise RuntimeError(f"no task for {_meta(pod).name}'s container {container}")


@dataclass
class Recovery:
    seconds: float
    # World ranks whose holder changed: a new pod instance, or a warm spare that now plays it.
    replaced: int
    # None when no new pod took a rank (warm spares did: they started before the kill).
    breakdown: dict[str, float] | None
    window: tuple[float, float]


def table_entry(core: client.CoreV1Api, namespace: str, name: str, world: str) -> WorldEntry | None:
    """The world's entry in the table the operator published (its memory holds it)."""
    try:
        configmap: Any = core.read_namespaced_config_map(name, namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    memory = read_memory({"binaryData": configmap.binary_data}) or {}
    entries = (memory.get("table") or {}).get("worlds") or []
    return next((WorldEntry.model_validate(e) for e in entries if e["name"] == world), None)


def kill_and_time(
    cluster: Any, core: client.CoreV1Api, namespace: str, name: str, world: str, victim: str, times: PodTimes
) -> Recovery:
    before = pods_of(core, namespace, name)
    epoch = int(world_status(core, namespace, name, world)["epoch"]) + 1
    entry = wait_for(f"{world} of {name} in the table", lambda: table_entry(core, namespace, name, world))
    holders = [_uid(before[p]) if p in before else None for p in entry.pods]
    playing = next(p for p in entry.pods if entry.plays.get(p, p) == f"{name}-{victim}")

    def running() -> client.V1Pod | None:
        """The victim's pod once its container runs: the pod read before may be an instance
        whose container the kubelet has not started yet (no container id to kill)."""
        pod = core.read_namespaced_pod(playing, namespace)
        containers = (pod.status and pod.status.container_statuses) or []
        return pod if any(c.container_id and c.state and c.state.running for c in containers) else None

    pod = wait_for(f"the container of {playing} running", running)
    started = time.time()
    support.signal_container(cluster, pod, "SIGKILL")

    def formed() -> float | None:
        """When world1 formed at the new epoch (the workers' clock), once the status says."""
        shown = world_status(core, namespace, name, world)
        at = shown.get("formedAt")
        if shown.get("epoch") != epoch or shown.get("phase") != "Running" or not at:
            return None
        return datetime.fromisoformat(str(at).replace("Z", "+00:00")).timestamp()

    end = wait_for(f"{world} of {name} back at epoch {epoch}", formed)

    def published() -> WorldEntry | None:
        found = table_entry(core, namespace, name, world)
        return found if found is not None and found.epoch == epoch else None

    entry = wait_for(f"{world} of {name} at epoch {epoch} in the table", published)
    now = pods_of(core, namespace, name)
    members = {p: now[p] for p in entry.pods}
    replaced = sum(a != _uid(b) for a, b in zip(holders, members.values(), strict=True))
    existed = {_uid(pod) for pod in before.values()}
    new = [pod for pod in members.values() if _uid(pod) not in existed]
    if not new:
        return Recovery(end - started, replaced, None, (started, end))
    starts = {_uid(pod): process_start(cluster, pod) for pod in new}
    last = max(new, key=lambda pod: starts[_uid(pod)])
    uid = _uid(last)
    marks = [started, times.seen[uid], times.scheduled[uid], starts[uid], end]
    breakdown = {stage: max(0.0, b - a) for stage, a, b in zip(STAGES, marks, marks[1:], strict=False)}
    return Recovery(end - started, replaced, breakdown, (started, end))


def step_times(core: client.CoreV1Api, namespace: str, pod: str, line: str) -> list[float]:
    text = core.read_namespaced_pod_log(pod, namespace, timestamps=True)
    stamps = []
    for entry in text.splitlines():
        stamp, _, message = entry.partition(" ")
        if line in message:
            stamps.append(datetime.fromisoformat(stamp[:26] + "+00:00").timestamp())
    return stamps


def every_pod_up(core: client.CoreV1Api, namespace: str, name: str, count: int) -> bool:
    """Whether the MultiWorld has its pods (`count` at least, spares included) and every world
    Running with each rank joined, as the operator shows it from what each worker told it
    (`formedAt`: a kill before that would hit a rendezvous, not a running world)."""
    status = multiworld(core.api_client, namespace, name).get("status") or {}
    worlds = (status.get("worlds") or {}).values()
    ready = all(
        w.get("phase") == "Running" and w.get("readyRanks") == w.get("size") and w.get("formedAt") for w in worlds
    )
    return len(pods_of(core, namespace, name)) >= count and bool(worlds) and ready


def multiworld(api: client.ApiClient, namespace: str, name: str) -> Any:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(
        "multiworld.io", "v1alpha1", namespace, "multiworlds", name
    )


def spares_ready(api: client.ApiClient, namespace: str, name: str, spares: dict[str, int]) -> bool:
    """Whether every member keeps its warm spares, all ready (the MultiWorld's status says)."""
    shown = (multiworld(api, namespace, name).get("status") or {}).get("spares") or {}
    return all(shown.get(member) == f"{count}/{count}" for member, count in spares.items())


def spec_seen(api: client.ApiClient, namespace: str, name: str) -> bool:
    """Whether the operator planned with the MultiWorld's current spec (an edit just applied)."""
    found = multiworld(api, namespace, name)
    return (found.get("status") or {}).get("observedGeneration") == found["metadata"]["generation"]


def apply(cluster: Any, core: client.CoreV1Api, namespace: str, name: str, path: Path, pods: int) -> None:
    """Apply the manifest (a new MultiWorld or an edit of the running one) and wait until the
    operator has seen it and every pod is up."""
    support.kubectl(cluster, "apply", "-n", namespace, "-f", str(path))
    wait_for(f"the operator seeing {path.name}", lambda: spec_seen(core.api_client, namespace, name))
    wait_for(f"every rank of {name} joined", lambda: every_pod_up(core, namespace, name, pods))


def time_kills(
    cluster: Any,
    core: client.CoreV1Api,
    namespace: str,
    name: str,
    world: str,
    victims: list[str],
    kills: int,
    times: PodTimes,
    pods: int,
    spares: dict[str, int] | None = None,
) -> list[Recovery]:
    recoveries = []
    for kill in range(kills):
        if spares:
            wait_for(
                f"the warm spares of {name} ready",
                lambda: (
                    spares_ready(core.api_client, namespace, name, spares) and every_pod_up(core, namespace, name, pods)
                ),
            )
        recovery = kill_and_time(cluster, core, namespace, name, world, victims[kill % len(victims)], times)
        print(
            f"{name}: kill {kill + 1}/{kills}: every rank back in {recovery.seconds:.2f} s, "
            f"{recovery.replaced} replaced",
            file=sys.stderr,
            flush=True,
        )
        recoveries.append(recovery)
    return recoveries


def sized_manifests(workdir: Path, name: str, size: int) -> dict[str, Path]:
    """examples/all_gather as support.example_manifest writes it, world1 of `size` members
    (w1's replicas: size - 1), one manifest per scenario: its replace rule and w1's spares."""
    base = yaml.safe_load(support.example_manifest("all_gather", name, workdir, interval=INTERVAL_S).read_text())
    paths = {}
    for scenario in SCENARIOS:
        manifest = copy.deepcopy(base)
        spec = manifest["spec"]
        (w1,) = (m for m in spec["members"] if m["name"] == "w1")
        w1["replicas"] = size - 1
        if scenario.spares:
            w1["spares"] = scenario.spares
        (world1,) = (w for w in spec["worlds"] if w["name"] == "world1")
        world1["failurePolicy"]["replace"] = scenario.replace
        paths[scenario.key] = workdir / f"{name}.{scenario.key}.yaml"
        paths[scenario.key].write_text(yaml.safe_dump(manifest))
    return paths


@dataclass
class Unaffected:
    restarts: int
    worst_gap: float
    median_gap: float


def run_size(
    cluster: Any, core: client.CoreV1Api, namespace: str, workdir: Path, size: int, kills: int, times: PodTimes
) -> tuple[dict[str, list[Recovery]], Unaffected]:
    """One MultiWorld of world1 with `size` members through every scenario, then deleted."""
    name = f"bench-world1-of-{size}"
    manifests = sized_manifests(workdir, name, size)
    victims = [f"w1-{i}" for i in reversed(range(size - 1))]
    member_pods = 1 + (size - 1) + 2  # the leader, w1's, w2's
    found = {}
    for scenario in SCENARIOS:
        pods = member_pods + scenario.spares
        apply(cluster, core, namespace, name, manifests[scenario.key], pods)
        print(f"{name}: {scenario.label}", file=sys.stderr, flush=True)
        spares = {"w1": scenario.spares} if scenario.spares else None
        found[scenario.key] = time_kills(cluster, core, namespace, name, "world1", victims, kills, times, pods, spares)
    restarts = int(world_status(core, namespace, name, "world2").get("restarts", 0))
    steps = step_times(core, namespace, f"{name}-w2-0", "from world2 has gathered tensors")
    worst, _ = common.worst_gap_in(steps, [r.window for rs in found.values() for r in rs])
    delete_example(cluster, core, namespace, name)
    return found, Unaffected(restarts, worst, statistics.median(common.gaps(steps)))


def delete_example(cluster: Any, core: client.CoreV1Api, namespace: str, name: str) -> None:
    support.kubectl(cluster, "delete", "mw", name, "-n", namespace, "--wait=false")
    wait_for(f"the pods of {name} gone", lambda: not pods_of(core, namespace, name) or None)


def figure(recoveries: list[Recovery]) -> dict[str, Any]:
    return {
        "recovery_s": common.Spread.of(r.seconds for r in recoveries).as_dict(),
        "replaced_per_kill": [r.replaced for r in recoveries],
    }


def counts(recoveries: list[Recovery]) -> str:
    found = sorted({r.replaced for r in recoveries})
    return ", ".join(map(str, found))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = common.machine_load()
    with (
        support.bench_cluster(args.cluster, 1) as cluster,
        tempfile.TemporaryDirectory(prefix="mw-bench-") as scratch,
        cluster.api_client() as api,
        support.installed_operator(cluster) as operator,
    ):
        core = client.CoreV1Api(api)
        sizes: dict[int, dict[str, list[Recovery]]] = {}
        with watching_pods(core, operator.apps) as times:
            # The example as committed first: the figures most wanted.
            for size in sorted(args.sizes, key=lambda n: n != EXAMPLE_SIZE):
                sizes[size], seen = run_size(cluster, core, operator.apps, Path(scratch), size, args.kills, times)
                if size == EXAMPLE_SIZE:
                    unaffected = seen
            name = "bench-single-world"
            path = support.example_manifest("single_world", name, Path(scratch), interval=INTERVAL_S)
            apply(cluster, core, operator.apps, name, path, 3)
            whole = time_kills(
                cluster, core, operator.apps, name, "world", ["workers-1", "workers-0"], args.kills, times, 3
            )
            delete_example(cluster, core, operator.apps, name)
    example = sizes[EXAMPLE_SIZE]
    spreads = {TOP_LEVEL[key]: common.Spread.of(r.seconds for r in example[key]) for key in TOP_LEVEL}
    spreads["whole_restart_s"] = common.Spread.of(r.seconds for r in whole)
    replaced = {TOP_LEVEL[key]: [r.replaced for r in example[key]] for key in TOP_LEVEL}
    replaced["whole_restart_s"] = [r.replaced for r in whole]
    breakdowns = [r.breakdown for r in example["new_pods"] if r.breakdown is not None]
    breakdown = {stage: statistics.median(b[stage] for b in breakdowns) for stage in STAGES}
    ratio = unaffected.worst_gap / unaffected.median_gap
    results = {
        **{key: spread.as_dict() for key, spread in spreads.items()},
        "replaced_per_kill": replaced,
        "sizes": {str(n): {key: figure(rs) for key, rs in found.items()} for n, found in sorted(sizes.items())},
        "breakdown_s": breakdown,
        "unaffected": {"restarts": unaffected.restarts, "worst_gap_ratio": ratio},
    }
    rows = []
    for n, found in sorted(sizes.items()):
        for scenario in SCENARIOS:
            rs = found[scenario.key]
            s = common.Spread.of(r.seconds for r in rs)
            rows.append([f"world1 of {n}, {scenario.label} (n={len(rs)})", common.fmt_s(s.min),
                         common.fmt_s(s.median), common.fmt_s(s.max), counts(rs)])  # fmt: skip
    s = spreads["whole_restart_s"]
    rows.append([f"single_world of 3, every rank (n={len(whole)})", common.fmt_s(s.min), common.fmt_s(s.median),
                 common.fmt_s(s.max), counts(whole)])  # fmt: skip
    pod_rule = [r.replaced for found in sizes.values() for key in ("new_pods", "one_spare") for r in found[key]]
    common.report(
        "recovery on a real node (kill through containerd -> every rank joined the new epoch)",
        load_at_start,
        [
            common.table(["recovery (world1 = leader + w1 pods)", "min", "median", "max", "replaced per kill"], rows),
            common.table(
                [f"stage (median, world1 of {EXAMPLE_SIZE}, new pods: last new pod to join)", "seconds"],
                [[stage, f"{breakdown[stage]:.3f}"] for stage in STAGES],
            ),
            f"world2 while world1 (of {EXAMPLE_SIZE}) recovered: {unaffected.restarts} restarts; worst step gap "
            f"{unaffected.worst_gap:.2f} s = {ratio:.2f}x the median gap ({unaffected.median_gap:.2f} s)",
        ],
        [
            common.Target("world2 restarts while world1 recovered", unaffected.restarts, 0),
            common.Target("pods replaced per kill under replace: Pod, most", max(pod_rule), 1),
            common.Target("world1 back with one warm spare, median", spreads["spare_recovery_s"].median, 1.0, "s"),
            common.Target(
                "world1 back with new pods, median, vs the whole-group restart",
                spreads["node_recovery_s"].median / spreads["whole_restart_s"].median,
                1.0,
                "x",
            ),
        ],
    )
    if args.json:
        common.json_line(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
