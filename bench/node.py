"""Recovery on a real node: a world1 worker of the all_gather example killed through the
container runtime, until world1 runs again, with warm spares and without (new pods); beside
them, the single_world example's whole-group restart (what LeaderWorkerSet and JobSet do by
default) and what the unaffected world saw.

Runs against a cluster with a node: its own, started in a temp dir (tests/cluster/cluster.py,
images from tests/cluster/images.py, the chart with the operator image), or a running one given
with --cluster (`make cluster`'s .cluster, or a test session's).

Clocks (wall time; the node, the workers and this process share the machine's clock):
- node_recovery_s: starts just before the SIGKILL is sent to the container (containerd's
  `tasks kill`) and stops at the last `joined_at` of world1's new epoch among its ranks, as each
  worker's runtime records it (its status annotation). Each kill takes the other worker of
  world1, after the previous recovery completed; the first restart has no backoff
  (`initialDelay: 0s`). world1's recovery replaces both its exclusive pods with new pods.
- spare_recovery_s: the same clock, with w1 keeping 2 warm spares (as many as world1's
  exclusive pods): each kill waits until both spares are ready (their workers waiting for an
  identity), and the killed pod is whichever plays that member pod now.
- breakdown_s, for the replaced rank that joined last: operator = kill -> its replacement Pod
  seen by a watch; schedule = -> the Pod seen bound to the node; container_start = -> the
  container's process started (its start time in /proc); import = -> the program ready, its
  imports done (the worker's `started`); rendezvous = -> joined the new epoch.
- whole_restart_s: the same clock for single_world (one plain torch world of 3 ranks): a dead
  worker fails the world, so every pod of it is recreated.
- unaffected: errors = world2 errors counted by its members' runtimes over the whole run;
  worst_gap_ratio = the longest gap between world2's steps (w2-0's log, kubelet timestamps)
  while world1 recovered, over the median gap.
"""

from __future__ import annotations

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

import _common as common
from harness import kube
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from multiworld.contract import STATUS_ANNOTATION, TABLE_ENTRY_KEY, WorkerStatus, WorldEntry, world_table_name

T = TypeVar("T")


cluster_module, images = kube.cluster_modules()
support = kube.kube_support("node_support")

STAGES = ("operator", "schedule", "container_start", "import", "rendezvous")
INTERVAL_S = 0.5
WAIT_S = 300.0


def parse_args(argv: list[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument(
        "--kills", type=common.positive(int), default=None, help="kills per example (default 5; 2 with --quick)"
    )
    p.add_argument("--cluster", type=Path, help="a running cluster's folder (with a node) instead of a new one")
    args = p.parse_args(argv)
    args.kills = args.kills or (2 if args.quick else 5)
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


def statuses(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, tuple[client.V1Pod, WorkerStatus | None]]:
    pods = core.list_namespaced_pod(namespace, label_selector=f"multiworld.io/name={name}").items
    found = {}
    for pod in pods:
        meta = _meta(pod)
        assert meta.name is not None
        if meta.deletion_timestamp is not None:
            continue
        raw = (meta.annotations or {}).get(STATUS_ANNOTATION)
        found[meta.name] = (pod, WorkerStatus.model_validate_json(raw) if raw else None)
    return found


def process_start(cluster: Any, pod: client.V1Pod) -> float:
    """Wall-clock start of the container's process: its /proc start time (in clock ticks since
    boot), placed on the wall clock through CLOCK_BOOTTIME."""
    container = support.container_id(pod)
    for line in cluster.node.ctr(["tasks", "ls"], "listing tasks").splitlines()[1:]:
        words = line.split()
        if words and words[0] == container:
            ticks = int(Path(f"/proc/{words[1]}/stat").read_text().rsplit(")", 1)[1].split()[19])
            since_boot = ticks / os.sysconf("SC_CLK_TCK")
            return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    raise RuntimeError(f"no task for {_meta(pod).name}'s container {container}")


@dataclass
class Recovery:
    seconds: float
    # None when no new pod took a rank (warm spares did: they started before the kill).
    breakdown: dict[str, float] | None
    window: tuple[float, float]


def table_entry(core: client.CoreV1Api, namespace: str, name: str, world: str) -> WorldEntry | None:
    """The world's live table entry (None: out of the table for a moment)."""
    try:
        configmap = core.read_namespaced_config_map(world_table_name(name, world), namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    assert configmap.data is not None
    return WorldEntry.model_validate_json(configmap.data[TABLE_ENTRY_KEY])


def kill_and_time(
    cluster: Any, core: client.CoreV1Api, namespace: str, name: str, world: str, victim: str, times: PodTimes
) -> Recovery:
    before = statuses(core, namespace, name)
    epoch = max(s.joined.get(world, 0) for _, s in before.values() if s is not None) + 1
    entry = wait_for(f"{world} of {name} in the table", lambda: table_entry(core, namespace, name, world))
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

    def rejoined() -> dict[str, tuple[client.V1Pod, WorkerStatus]] | None:
        """Every rank of the world's table entry joined at the new epoch."""
        entry = table_entry(core, namespace, name, world)
        if entry is None or entry.epoch != epoch:
            return None
        now = statuses(core, namespace, name)
        ranks = {p: now.get(p, (None, None)) for p in entry.pods}
        if all(s is not None and s.joined.get(world) == epoch for _, s in ranks.values()):
            return ranks  # type: ignore[return-value]  # every status is there: checked just above
        return None

    members = wait_for(f"{world} of {name} back at epoch {epoch}", rejoined)
    joined = {p: s.joined_at[world].timestamp() for p, (_, s) in members.items()}
    end = max(joined.values())
    replaced = [p for p, (pod, _) in members.items() if p not in before or _uid(before[p][0]) != _uid(pod)]
    if not replaced:
        return Recovery(end - started, None, (started, end))
    last = max(replaced, key=joined.__getitem__)
    pod, status = members[last]
    uid = _uid(pod)
    assert status.started is not None
    marks = [
        started,
        times.seen[uid],
        times.scheduled[uid],
        process_start(cluster, pod),
        status.started.timestamp(),
        end,
    ]
    breakdown = {stage: max(0.0, b - a) for stage, a, b in zip(STAGES, marks, marks[1:], strict=False)}
    return Recovery(end - started, breakdown, (started, end))


def step_times(core: client.CoreV1Api, namespace: str, pod: str, line: str) -> list[float]:
    text = core.read_namespaced_pod_log(pod, namespace, timestamps=True)
    stamps = []
    for entry in text.splitlines():
        stamp, _, message = entry.partition(" ")
        if line in message:
            stamps.append(datetime.fromisoformat(stamp[:26] + "+00:00").timestamp())
    return stamps


def every_pod_up(core: client.CoreV1Api, namespace: str, name: str) -> bool:
    """Whether the MultiWorld has its pods (3 at least) and each one's worker is in its worlds
    or, a warm spare, waits for an identity."""
    found = statuses(core, namespace, name)
    return len(found) >= 3 and all(s is not None and (s.joined or s.waiting) for _, s in found.values())


def spares_ready(api: client.ApiClient, namespace: str, name: str, spares: dict[str, int]) -> bool:
    """Whether every member keeps its warm spares, all ready (the MultiWorld's status says)."""
    found: Any = client.CustomObjectsApi(api).get_namespaced_custom_object(
        "multiworld.io", "v1alpha1", namespace, "multiworlds", name
    )
    shown = (found.get("status") or {}).get("spares") or {}
    return all(shown.get(member) == f"{count}/{count}" for member, count in spares.items())


def run_example(
    cluster: Any,
    core: client.CoreV1Api,
    operator: Any,
    workdir: Path,
    example: str,
    name: str,
    world: str,
    victims: list[str],
    kills: int,
    times: PodTimes,
    spares: dict[str, int] | None = None,
) -> list[Recovery]:
    path = support.example_manifest(example, name, workdir, interval=INTERVAL_S, spares=spares)
    support.kubectl(cluster, "apply", "-n", operator.apps, "-f", str(path))
    wait_for(f"every rank of {name} joined", lambda: every_pod_up(core, operator.apps, name))
    recoveries = []
    for kill in range(kills):
        if spares:
            wait_for(
                f"the warm spares of {name} ready",
                lambda: (
                    spares_ready(core.api_client, operator.apps, name, spares)
                    and every_pod_up(core, operator.apps, name)
                ),
            )
        recovery = kill_and_time(cluster, core, operator.apps, name, world, victims[kill % len(victims)], times)
        print(
            f"{name}: kill {kill + 1}/{kills}: every rank back in {recovery.seconds:.2f} s", file=sys.stderr, flush=True
        )
        recoveries.append(recovery)
    return recoveries


def delete_example(cluster: Any, core: client.CoreV1Api, namespace: str, name: str) -> None:
    support.kubectl(cluster, "delete", "mw", name, "-n", namespace, "--wait=false")
    wait_for(f"the pods of {name} gone", lambda: not statuses(core, namespace, name) or None)


@contextmanager
def node_cluster(given: Path | None) -> Iterator[Any]:
    if given is not None:
        cluster = cluster_module.Cluster(given)
        if "kubelet" not in cluster.running_components():
            raise SystemExit(f"--cluster {given}: no node runs there (`make cluster` starts one)")
        images.load_images(str(cluster.node.socket))
        yield cluster
        return
    with tempfile.TemporaryDirectory(prefix="mw-bench-node-") as folder:
        cluster = cluster_module.Cluster(Path(folder))
        cluster.start(cluster_module.find_binaries(), detach=False, nodes=1)
        try:
            images.load_images(str(cluster.node.socket))
            yield cluster
        finally:
            cluster.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = common.machine_load()
    with (
        node_cluster(args.cluster) as cluster,
        tempfile.TemporaryDirectory(prefix="mw-bench-") as scratch,
        cluster.api_client() as api,
    ):
        core = client.CoreV1Api(api)
        operator = support.install_operator(cluster)
        with watching_pods(core, operator.apps) as times:
            multi = run_example(
                cluster,
                core,
                operator,
                Path(scratch),
                "all_gather",
                "bench-all-gather",
                "world1",
                ["w1-1", "w1-0"],
                args.kills,
                times,
            )
            errors = sum(
                s.errors.get("world2", 0)
                for _, s in statuses(core, operator.apps, "bench-all-gather").values()
                if s is not None
            )
            steps = step_times(core, operator.apps, "bench-all-gather-w2-0", "from world2 has gathered tensors")
            delete_example(cluster, core, operator.apps, "bench-all-gather")
            warm = run_example(
                cluster,
                core,
                operator,
                Path(scratch),
                "all_gather",
                "bench-spares",
                "world1",
                ["w1-1", "w1-0"],
                args.kills,
                times,
                spares={"w1": 2},
            )
            delete_example(cluster, core, operator.apps, "bench-spares")
            whole = run_example(
                cluster,
                core,
                operator,
                Path(scratch),
                "single_world",
                "bench-single-world",
                "world",
                ["workers-1", "workers-0"],
                args.kills,
                times,
            )
            delete_example(cluster, core, operator.apps, "bench-single-world")
    median_gap = statistics.median(common.gaps(steps))
    worst, _ = common.worst_gap_in(steps, [r.window for r in multi])
    recovery = common.Spread.of(r.seconds for r in multi)
    spare = common.Spread.of(r.seconds for r in warm)
    restart = common.Spread.of(r.seconds for r in whole)
    breakdowns = [r.breakdown for r in multi if r.breakdown is not None]
    breakdown = {stage: statistics.median(b[stage] for b in breakdowns) for stage in STAGES}
    results = {
        "node_recovery_s": recovery.as_dict(),
        "spare_recovery_s": spare.as_dict(),
        "breakdown_s": breakdown,
        "whole_restart_s": restart.as_dict(),
        "unaffected": {"errors": errors, "worst_gap_ratio": worst / median_gap},
    }
    rows = [[f"{label} (n={n})", common.fmt_s(s.min), common.fmt_s(s.median), common.fmt_s(s.max)]
            for label, s, n in (("all_gather, warm spares: world1 back", spare, len(warm)),
                                ("all_gather, new pods: world1 back", recovery, len(multi)),
                                ("single_world: every rank back", restart, len(whole)))]  # fmt: skip
    common.report(
        "recovery on a real node (kill through containerd -> every rank joined the new epoch)",
        load_at_start,
        [
            common.table(["recovery", "min", "median", "max"], rows),
            common.table(
                ["stage (median, new pods: last rank to join)", "seconds"],
                [[stage, f"{breakdown[stage]:.3f}"] for stage in STAGES],
            ),
            f"world2 while world1 recovered: {errors} errors; worst step gap {worst:.2f} s "
            f"= {worst / median_gap:.2f}x the median gap ({median_gap:.2f} s)",
        ],
        [
            common.Target("world2 errors while world1 recovered", errors, 0),
            common.Target("world1 back with warm spares, median", spare.median, 1.0, "s"),
            common.Target(
                "world1 back, median, vs the whole-group restart", recovery.median / restart.median, 1.0, "x"
            ),
        ],
    )
    if args.json:
        common.json_line(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
