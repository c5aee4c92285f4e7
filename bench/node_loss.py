"""Node loss on real nodes: a node powered off or cut off the network, until every world with a
rank there runs again, with a new pod or a warm spare on the other node; beside it, what
Kubernetes' own path would cost on the same cluster.

Runs against a cluster of two nodes or more: its own, started in a temp dir (tests/cluster, our
images, the chart), or a running one given with --cluster (`make cluster NODES=2`'s .cluster).
The operator runs on the first node; the second is the one lost.

Each trial applies examples/all_gather (the leader in world1 and world2, two pods of each world
besides) as a MultiWorld of its own, with its leader asked onto the lost node and every other pod
onto the kept one (a preferred node affinity, which the operator's own preference for another
node than a silent pod's outweighs, so the replacement may go elsewhere). With a warm spare, the
leader's spare is added once it runs (`spares: 1`, kubectl apply), placed where the operator
places it by default: off the leader's node, so on the kept one. Then the fault (tests/cluster's
`power-off` or `partition`), the watch until both worlds run at a new epoch with no rank on the
lost node, the node healed, and the MultiWorld deleted.

Clocks (wall time; the nodes, the workers and this process share the machine's clock):
- recovery_s: from just before the fault until the later of the two worlds' `formedAt` at its
  new epoch (the moment its last rank joined, by that worker's clock, as the status shows it).
- kubernetes_path_s: in the first power-off trial, after the worlds are back, the wait goes on
  until the Node's Ready condition leaves True (the node lifecycle controller's grace period):
  not_ready_s from the fault; eviction_s = not_ready_s + the lost pod's toleration of
  `node.kubernetes.io/unreachable` (tolerationSeconds, 300 s by the API server's default),
  when its pods would be evicted and a controller that waits for that (LeaderWorkerSet, JobSet,
  a StatefulSet) would begin to replace them. Computed from the same cluster's settings: the
  eviction is not waited for.

--mode keeps one mode; --dead-after sets MULTIWORLD_DEAD_AFTER in the pods (the detection of a
silent peer, which most of a warm spare's recovery is); --logs DIR runs the pods with
MULTIWORLD_LOG_LEVEL=DEBUG and keeps, per trial, every pod's log and the operator's since the
fault, each line with the container runtime's timestamp (DIR/<multiworld>/<pod>.log), to read
where a slow trial's time went.

JSON (--json, the last line): scenarios: {"<fault>/<mode>": {"recovery_s": {min, median, max},
"trials": [seconds, ...], "by_spare": [whether a warm spare holds the leader's ranks after
each trial, ...]}} for fault in power-off, partition and mode in new_pod, warm_spare;
kubernetes_path_s: {not_ready_s, eviction_s, toleration_s}.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from tests.cluster.cluster import Cluster
from tests.support import bench_common as common, node_support as support
from tests.support.node_loss import Timeline, add_spare, formed_at, placed_by_preference, watch_recovery
from tests.support.operator_support import KubeNamespace, wait_for

FAULTS = ("power-off", "partition")
MODES = ("new_pod", "warm_spare")
# --quick: each fault and each mode once (tests/kube/test_node_loss.py's journeys take the other two).
QUICK = (("power-off", "new_pod"), ("partition", "warm_spare"))
WAIT_S = 300.0
RECOVERY_LIMIT_S = 420.0
PLACEMENT_ATTEMPTS = 5
UNREACHABLE = "node.kubernetes.io/unreachable"
SPARE_LABEL = "multiworld.io/spare"
# The DefaultTolerationSeconds admission plugin's default, when a pod shows none.
DEFAULT_TOLERATION_S = 300.0
# The targets of issue 34: a world back with a warm spare, and with a new pod.
SPARE_TARGET_S = 1.0
NEW_POD_TARGET_S = 5.0


@dataclass(frozen=True)
class Trial:
    seconds: float
    by_spare: bool  # whether a warm spare holds the lost leader's ranks now (else a new pod)


@dataclass(frozen=True)
class KubernetesPath:
    not_ready_s: float
    toleration_s: float

    @property
    def eviction_s(self) -> float:
        return self.not_ready_s + self.toleration_s


def parse_args(argv: list[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.setting("--trials", int, 5, 1, "trials per fault and mode")
    p.add_argument("--cluster", type=Path, help="a running cluster's folder (two nodes or more) instead of a new one")
    p.add_argument("--mode", choices=MODES, help="only this mode (default: both)")
    p.add_argument(
        "--dead-after",
        type=common.positive(float),
        help="MULTIWORLD_DEAD_AFTER in the pods' env: how long a silent peer takes to be judged dead "
        "(default: the library's own)",
    )
    p.add_argument("--logs", type=Path, help="keep each trial's pod and operator logs, timestamped, under this folder")
    args = p.parse_args(argv)
    scenarios = QUICK if args.quick else tuple((f, m) for f in FAULTS for m in MODES)
    args.scenarios = tuple((f, m) for f, m in scenarios if args.mode in (None, m))
    return args


def _running(kube: KubeNamespace, name: str) -> dict[str, Any] | None:
    status = kube.status(name)
    worlds = status.get("worlds") or {}
    up = status.get("phase") == "Running" and worlds and all(formed_at(w) for w in worlds.values())
    return status if up else None


def _set_env(path: Path, name: str, value: str) -> None:
    """`name`=`value` in the container env of every member's template in the manifest at `path`."""
    manifest = yaml.safe_load(path.read_text())
    for member in manifest["spec"]["members"]:
        (container,) = member["template"]["spec"]["containers"]
        container["env"] = [e for e in container.get("env") or [] if e["name"] != name] + [
            {"name": name, "value": value}
        ]
    path.write_text(yaml.safe_dump(manifest))


def _keep_logs(
    cluster: Cluster, operator: support.Operator, kube: KubeNamespace, name: str, fault: float, folder: Path
) -> None:
    """Every pod's log of MultiWorld `name` and the operator's since `fault` (epoch seconds), with
    the runtime's timestamps, into `folder`; a pod on the lost node has none to give."""
    folder.mkdir(parents=True, exist_ok=True)
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(fault - 1))
    sources = [(pod, ["-n", operator.apps, pod]) for pod in kube.pods(name)]
    sources.append(("operator", ["-n", operator.namespace, f"deployment/{operator.fullname}", f"--since-time={since}"]))
    for label, args in sources:
        text = support.kubectl(cluster, "logs", "--timestamps", *args, check=False)
        (folder / f"{label}.log").write_text(text)
    print(f"{name}: logs in {folder}", flush=True)


def _not_ready_after(core: client.CoreV1Api, node: str, fault: float) -> float:
    """Seconds from the fault until the Node's Ready condition left True."""

    def changed() -> float | None:
        conditions = core.read_node(node).status.conditions or []
        ready = next(c for c in conditions if c.type == "Ready")
        return None if ready.status == "True" else ready.last_transition_time.timestamp() - fault

    return wait_for(f"node {node} NotReady", changed, WAIT_S)


def _toleration(pod: client.V1Pod) -> float:
    for toleration in pod.spec.tolerations or []:
        if toleration.key == UNREACHABLE and toleration.toleration_seconds is not None:
            return float(toleration.toleration_seconds)
    return DEFAULT_TOLERATION_S


@contextmanager
def _leader_on_lost(
    cluster: Cluster,
    operator: support.Operator,
    kube: KubeNamespace,
    scratch: Path,
    base: str,
    dead_after: float | None,
    logs: Path | None,
) -> Iterator[tuple[str, Path]]:
    """examples/all_gather applied and Running with its leader alone on the node to lose: the
    other members prefer the kept node; the leader is left to the scheduler (a preference of its
    own would follow its replacement too), and the MultiWorld made again where it lands
    elsewhere. Yields its name and manifest; deleted after."""
    lost, kept = cluster.nodes[1].name, cluster.nodes[0].name
    for attempt in range(PLACEMENT_ATTEMPTS):
        name = f"{base}-{attempt}"
        path = support.example_manifest("all_gather", name, scratch)
        placed_by_preference(path, set(), lost, kept, unplaced={"leader"})
        if dead_after is not None:
            _set_env(path, "MULTIWORLD_DEAD_AFTER", str(dead_after))
        if logs is not None:
            _set_env(path, "MULTIWORLD_LOG_LEVEL", "DEBUG")
        with support.applied(cluster, operator, kube, path, name):
            wait_for(f"{name} Running", lambda: _running(kube, name), WAIT_S)  # noqa: B023  (called at once)
            placed = {p: pod.spec.node_name for p, pod in kube.pods(name).items()}
            if all((node == lost) == p.startswith(f"{name}-leader-") for p, node in placed.items()):
                yield name, path
                return
        print(f"{name}: placed {placed}, not the leader alone on {lost}; made again", flush=True)
    raise SystemExit(f"{base}: the leader never landed alone on {lost} in {PLACEMENT_ATTEMPTS} attempts")


def trial(
    cluster: Cluster,
    operator: support.Operator,
    kube: KubeNamespace,
    scratch: Path,
    fault: str,
    mode: str,
    index: int,
    measure_kubernetes: bool,
    detach: bool,
    dead_after: float | None,
    logs: Path | None,
) -> tuple[Trial, KubernetesPath | None]:
    """One fault of the second node; returns the seconds until both worlds are back (and, when
    asked, what Kubernetes' own path would take)."""
    lost = cluster.nodes[1].name
    path_k8s = None
    base = f"loss-{fault}-{mode.replace('_', '-')}-{index}"
    with _leader_on_lost(cluster, operator, kube, scratch, base, dead_after, logs) as (name, path):
        status = kube.status(name)
        if mode == "warm_spare":
            add_spare(cluster, operator, kube, path, name, "leader")
        pods = kube.pods(name)
        leader = f"{name}-leader-0"
        epochs = {w: s["epoch"] for w, s in status["worlds"].items()}
        leader_rank = {w: entry["pods"].index(leader) for w, entry in kube.table(name).items()}
        timeline = Timeline(time.time())
        try:
            if fault == "power-off":
                cluster.power_off(lost)
            else:
                cluster.partition(lost)
            back = watch_recovery(kube, name, lost, set(epochs), epochs, timeline, RECOVERY_LIMIT_S)
            if measure_kubernetes:
                not_ready = _not_ready_after(kube.core, lost, timeline.fault)
                path_k8s = KubernetesPath(not_ready, _toleration(pods[leader]))
            table, after = kube.table(name), kube.pods(name)
        finally:
            print(f"{name}, {fault} of {lost}:\n{timeline}", flush=True)
            # A cluster given with --cluster outlives this process: so must the node's daemons.
            cluster.heal(lost, detach=detach)
        if logs is not None:
            _keep_logs(cluster, operator, kube, name, timeline.fault, logs / name)
    holders = [after[table[w]["pods"][rank]] for w, rank in leader_rank.items()]
    by_spare = all((pod.metadata.labels or {}).get(SPARE_LABEL) == "true" for pod in holders)
    seconds = max(back.values())
    how = "a warm spare" if by_spare else "a new pod"
    print(f"{fault}, {mode}, trial {index}: both worlds back in {seconds:.2f} s, the leader's ranks held by {how}")
    return Trial(seconds, by_spare), path_k8s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = common.machine_load()
    trials: dict[tuple[str, str], list[Trial]] = {s: [] for s in args.scenarios}
    path_k8s: KubernetesPath | None = None
    with (
        support.bench_cluster(args.cluster, 2) as cluster,
        tempfile.TemporaryDirectory(prefix="mw-bench-") as scratch,
        cluster.api_client() as api,
        support.installed_operator(cluster, node=cluster.nodes[0].name) as operator,
    ):
        kube = KubeNamespace(api, operator.apps)
        # Scenarios interleaved, so that a slow minute of the machine does not land on one alone.
        for index in range(args.trials):
            for fault, mode in args.scenarios:
                measure = fault == "power-off" and path_k8s is None
                done, measured = trial(
                    cluster,
                    operator,
                    kube,
                    Path(scratch),
                    fault,
                    mode,
                    index,
                    measure,
                    args.cluster is not None,
                    args.dead_after,
                    args.logs,
                )
                trials[(fault, mode)].append(done)
                path_k8s = measured or path_k8s
    spreads = {key: common.Spread.of(t.seconds for t in done) for key, done in trials.items()}
    rows = [
        [
            f"{fault}, {mode.replace('_', ' ')} (n={len(trials[(fault, mode)])})",
            common.fmt_s(s.min),
            common.fmt_s(s.median),
            common.fmt_s(s.max),
        ]
        for (fault, mode), s in spreads.items()
    ]
    body = [common.table(["scenario: fault to both worlds back", "min", "median", "max"], rows)]
    if path_k8s is not None:
        body.append(
            f"Kubernetes' own path on this cluster: the Node NotReady {path_k8s.not_ready_s:.1f} s after the "
            f"power-off; its pods evicted {path_k8s.toleration_s:.0f} s later (their toleration of {UNREACHABLE}), "
            f"at {path_k8s.eviction_s:.0f} s: only then would a controller that waits for the eviction replace them"
        )
    targets = [
        common.Target(
            f"{fault}, {mode.replace('_', ' ')}: median recovery",
            s.median,
            SPARE_TARGET_S if mode == "warm_spare" else NEW_POD_TARGET_S,
            " s",
        )
        for (fault, mode), s in spreads.items()
    ]
    setting = f"dead_after {args.dead_after:g} s" if args.dead_after is not None else "the default dead_after"
    common.report(f"node loss on real nodes ({setting})", load_at_start, body, targets)
    if args.json:
        common.json_line(
            {
                "scenarios": {
                    f"{fault}/{mode}": {
                        "recovery_s": spreads[(fault, mode)].as_dict(),
                        "trials": [t.seconds for t in done],
                        "by_spare": [t.by_spare for t in done],
                    }
                    for (fault, mode), done in trials.items()
                },
                "kubernetes_path_s": None
                if path_k8s is None
                else {
                    "not_ready_s": path_k8s.not_ready_s,
                    "eviction_s": path_k8s.eviction_s,
                    "toleration_s": path_k8s.toleration_s,
                },
            }
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
