"""The operator at scale against a real API server: a MultiWorld of as many worlds as one pod
may be in must react as fast as one of 2, and what a failure costs everyone else must not grow
with the worlds; and the largest spec the caps admit must plan in time and memory, and fit what
is written for it in its objects.

The scene is bench/operator_failures.py's: its own control plane, the chart installed for real, the
operator as a process of its own, and a stand-in kubelet that marks each new pod Running
kubelet_stand_in.START_S after it appears and fails pods on request, through their status.

MultiWorlds are stars: a leader (router) in every world w<i>, and one exclusive pod m<i>-0 per
world; the largest is LARGEST_STAR worlds (the leader is in every one: spec/limits.py's
MAX_WORLDS_PER_POD). Per size (worlds):
- create_s: from the create call until the last pod exists (seen through a watch).
- object_kib: the MultiWorld as the API server returns it (managedFields included) once every
  world is Running.
- react_s: median over FAILURES failures, a different replica each time: from just before the
  status patch that marks the pod Failed until its replacement, stamped with the new epoch,
  is seen by a watch.
- worker_watch_kib_per_failure: a worker's channel (multiworld.channels.stream, the one in every
  pod, with a token bound to that pod) runs here for the pod of an unaffected world; the bytes of
  the tables it received from each failure until the failed world was Running again, mean.
- operator_rss_mib: the operator's peak resident memory (VmHWM) once that size has run.
- many: MANY MultiWorlds of MANY_WORLDS worlds each. react_s across them (a different
  MultiWorld each failure) beside `single`, the same failures of one such MultiWorld measured
  before the others were created.
- object_kib at OBJECT_WORLDS worlds: created and run once with the default failure policy,
  for its size (and its parts: spec, status, managedFields) only.
- largest accepted spec (alone with --largest: no API server): the spec at every cap of spec/limits.py
  at once, names of 63 characters (tests/support/limits_support.py: the real planner, pod bodies
  and worker annotations), planned in this process as the operator plans it.
  - plan_first: one plan() call on the first observation (nothing exists yet); plan_failure:
    one plan() call on the observation in which the pod in most worlds failed, once every pod
    ran. Each clock starts just before the call and stops when it returns: wall (perf_counter)
    and this thread's CPU time (thread_time).
  - plan_peak_mib: tracemalloc's peak over either call (Python's allocations, the plan it
    returns included); operator_rss_mib: the peak resident memory (VmHWM) of a fresh
    interpreter that imported the operator (kopf, the Kubernetes client) and made both plans.
  - Sizes, each against its limit: the CR's status at its largest (every pod failed with a
    message of MAX_MESSAGE characters, every replacement waiting with one), against what etcd's
    object limit leaves beside a spec at its cap, annotations at theirs and other metadata;
    the planner's memory ConfigMap, data against a ConfigMap's limit; the MULTIWORLD_WORLDS
    string of the pod in most worlds (its pod body, NUL included) against Linux's limit on one
    environment string, that pod's annotations against the API server's limit on them, and its
    worker's longest message against the line the worker channel reads.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kubernetes import client

from multiworld.contract import NAME_LABEL
from multiworld_operator.kube.memory.planner_memory import MAX_MEMORY_BYTES, MAX_MEMORY_VALUES
from multiworld_operator.spec.limits import MAX_WORLDS, MAX_WORLDS_PER_POD
from tests.support import bench_common as common, limits_support as limits
from tests.support.kubelet_stand_in import DESCRIBED
from tests.support.operator_scene import GROUP, PLURAL, VERSION, Scene, fail_and_recover, scene, start, wait_for
from tests.support.worker_link import WorkerLink

# How long the worker link waits for its first table.
TABLE_WAIT_S = 60.0

LARGEST_STAR = min(MAX_WORLDS, MAX_WORLDS_PER_POD)
SIZES = (2, 100, LARGEST_STAR)
QUICK_SIZES = (2, 10)
FAILURES = 20
OBJECT_WORLDS = LARGEST_STAR
MANY, MANY_WORLDS = 200, 4

REACT_LIMIT_S = 0.3
WATCH_GROWTH_LIMIT = 2.0
OBJECT_LIMIT_KIB = 1024.0
OPERATOR_RSS_LIMIT_MIB = 256.0
CREATE_LIMIT_S = 10.0
AS_FAST_AS = 1.5


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument(
        "--sizes",
        type=common.positive(int),
        nargs="+",
        default=None,
        help=f"MultiWorld sizes in worlds (default {' '.join(map(str, SIZES))})",
    )
    p.setting("--failures", int, FAILURES, 3, "failures timed per size")
    p.setting("--object-worlds", int, OBJECT_WORLDS, 20, "the size whose object alone is measured")
    p.setting("--many", int, MANY, 3, f"MultiWorlds of {MANY_WORLDS} worlds for the many-MultiWorlds figure")
    p.add_argument(
        "--largest", action="store_true", help="only the largest accepted spec's figures (no API server needed)"
    )
    common.credentials_flag(p)
    args = p.parse_args(argv)
    args.sizes = args.sizes or list(QUICK_SIZES if args.quick else SIZES)
    too_large = [w for w in [*args.sizes, args.object_worlds] if w > LARGEST_STAR]
    if too_large:
        p.error(f"a star of more than {LARGEST_STAR} worlds is refused by the spec's caps: {too_large}")
    return args


def served_object(scene: Scene, name: str) -> bytes:
    """The MultiWorld as the API server serves it (what etcd's limit applies to)."""
    # The raw urllib3 response (_preload_content=False), not the object the client's annotations name.
    response: Any = client.CustomObjectsApi(scene.api).get_namespaced_custom_object(
        GROUP, VERSION, scene.kube.namespace, PLURAL, name, _preload_content=False
    )
    return bytes(response.data)


def object_kib(scene: Scene, name: str) -> float:
    return len(served_object(scene, name)) / 1024


def delete(scene: Scene, name: str) -> None:
    """Delete a MultiWorld and its pods (at once, rather than at the garbage collector's pace),
    and wait until they are gone, so the next size starts clean."""
    scene.kube.delete(name)
    client.CoreV1Api(scene.api).delete_collection_namespaced_pod(
        scene.kube.namespace, label_selector=f"{NAME_LABEL}={name}", grace_period_seconds=0
    )
    wait_for(f"the pods of {name} gone", lambda: not scene.kube.pods(name))


def measure_size(scene: Scene, worlds: int, failures: int) -> dict[str, float]:
    name = f"s{worlds}"
    create_s = start(scene, name, worlds)
    size_kib = object_kib(scene, name)
    observed = worlds - 1  # the unaffected worker's world: never failed here
    reacts, received = [], []
    with (
        tempfile.TemporaryDirectory() as folder,
        WorkerLink(client.CoreV1Api(scene.api), scene.kube.namespace, f"{name}-m{observed}-0", Path(folder)) as link,
    ):
        link.wait_table(TABLE_WAIT_S)
        for k in range(failures):
            before = link.bytes_received
            reacts.append(fail_and_recover(scene, name, k % max(1, worlds - 1)))
            received.append((link.bytes_received - before) / 1024)
    figures = {
        "create_s": create_s,
        "object_kib": size_kib,
        "react_s": statistics.median(reacts),
        "react_p99_s": common.p99(reacts),
        "worker_watch_kib_per_failure": statistics.mean(received),
        "operator_rss_mib": scene.operator.peak_rss_mib(),
    }
    print(f"{worlds} worlds: {figures}", file=sys.stderr, flush=True)
    delete(scene, name)
    return figures


def measure_object(scene: Scene, worlds: int) -> dict[str, float]:
    """The object's size, and its parts, with the default failure policy (the figures above
    give every world a policy of its own, so that repeated failures restart at once)."""
    name = f"o{worlds}"
    start(scene, name, worlds, policy=None)
    raw = served_object(scene, name)
    body = json.loads(raw)
    parts = {
        "total": len(raw) / 1024,
        "spec": _kib(body["spec"]),
        "status": _kib(body["status"]),
        "managedFields": _kib(body["metadata"].get("managedFields", [])),
    }
    delete(scene, name)
    return parts


def _kib(value: Any) -> float:
    return len(json.dumps(value, separators=(",", ":"))) / 1024


def star_name(i: int) -> str:
    return f"many{i}"


def measure_many(scene: Scene, count: int, failures: int) -> dict[str, float]:
    """react of one small MultiWorld alone, then across `count` of them."""
    start(scene, star_name(0), MANY_WORLDS)
    single = [fail_and_recover(scene, star_name(0), k % MANY_WORLDS) for k in range(failures)]
    for i in range(1, count):
        start(scene, star_name(i), MANY_WORLDS)
    many = [fail_and_recover(scene, star_name(1 + k % (count - 1)), k % MANY_WORLDS) for k in range(failures)]
    return {
        "single_react_s": statistics.median(single),
        "react_s": statistics.median(many),
        "operator_rss_mib": scene.operator.peak_rss_mib(),
    }


def growth(small: float, large: float) -> float:
    """large / small; nothing at both sizes is no growth."""
    if small == 0:
        return 1.0 if large == 0 else float("inf")
    return large / small


def cluster_figures(args: Any) -> tuple[str, list[str], list[common.Target], dict[str, Any]]:
    """The rows on the API server: the load at the start, the text, the targets, the JSON."""
    by_size: dict[int, dict[str, float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="bench-scale-") as directory,
        scene(Path(directory), args.credentials) as the_scene,
    ):
        for worlds in args.sizes:
            by_size[worlds] = measure_size(the_scene, worlds, args.failures)
        big_object = measure_object(the_scene, args.object_worlds)
        many = measure_many(the_scene, args.many, args.failures)
        credentials, loaded = the_scene.credentials, the_scene.loaded

    smallest, largest = min(by_size), max(by_size)
    rows = [
        [
            str(w),
            common.fmt_s(f["create_s"]),
            f"{f['object_kib']:.1f}",
            common.fmt_s(f["react_s"]),
            common.fmt_s(f["react_p99_s"]),
            f"{f['worker_watch_kib_per_failure']:.2f}",
            f"{f['operator_rss_mib']:.0f}",
        ]
        for w, f in by_size.items()
    ]
    body = [
        f"operator: `multiworld operator` in its own process, as {credentials}\n"
        f"{DESCRIBED}\n"
        f"MultiWorlds: a leader in every world w<i>, one exclusive pod m<i>-0 per world; "
        f"{args.failures} failures per size",
        common.table(
            [
                "worlds",
                "create",
                "object KiB",
                "react median",
                "react p99",
                "unaffected worker KiB/failure",
                "operator peak RSS MiB",
            ],
            rows,
        ),
        f"object at {args.object_worlds} worlds (every world Running, the default failure policy): "
        f"{big_object['total']:.1f} KiB: spec {big_object['spec']:.1f}, status {big_object['status']:.1f}, "
        f"managedFields {big_object['managedFields']:.1f}",
        f"{args.many} MultiWorlds of {MANY_WORLDS} worlds: react median {common.fmt_s(many['react_s'])}; "
        f"one alone, before the others existed: {common.fmt_s(many['single_react_s'])}; "
        f"operator peak RSS {many['operator_rss_mib']:.0f} MiB",
    ]
    watch_growth = growth(
        by_size[smallest]["worker_watch_kib_per_failure"], by_size[largest]["worker_watch_kib_per_failure"]
    )
    targets = [
        *(
            common.Target(f"react median at {w} worlds", by_size[w]["react_s"], REACT_LIMIT_S, " s")
            for w in (smallest, largest)
        ),
        common.Target(
            f"unaffected worker's bytes per failure, {largest} vs {smallest} worlds",
            watch_growth,
            WATCH_GROWTH_LIMIT,
            "x",
        ),
        common.Target(f"object at {args.object_worlds} worlds", big_object["total"], OBJECT_LIMIT_KIB, " KiB"),
        common.Target(f"create at {largest} worlds", by_size[largest]["create_s"], CREATE_LIMIT_S, " s"),
        common.Target(
            f"operator peak RSS at {largest} worlds",
            by_size[largest]["operator_rss_mib"],
            OPERATOR_RSS_LIMIT_MIB,
            " MiB",
        ),
        common.Target(
            f"react of {args.many} MultiWorlds vs one alone", many["react_s"] / many["single_react_s"], AS_FAST_AS, "x"
        ),
    ]

    def per(key: str) -> dict[str, float]:
        return {str(w): f[key] for w, f in by_size.items()}

    results = {
        "react_s": per("react_s"),
        "object_kib": {**per("object_kib"), str(args.object_worlds): big_object["total"]},
        "worker_watch_kib_per_failure": per("worker_watch_kib_per_failure"),
        "create_s": per("create_s"),
        "operator_rss_mib": per("operator_rss_mib"),
        "many": {"react_s": many["react_s"], "single_react_s": many["single_react_s"]},
    }
    return loaded, body, targets, results


def measure_largest() -> dict[str, Any]:
    """The largest accepted spec's figures (the docstring says what each is)."""
    figures = limits.measure_largest().as_dict()
    figures["plan_peak_mib"] = limits.plan_peak_mib()
    figures["operator_rss_mib"] = limits.operator_rss_mib()
    return figures


def largest_rows(f: dict[str, Any]) -> tuple[list[str], list[common.Target]]:
    first, failure = f["plan_first"], f["plan_failure"]
    chart_mib = limits.chart_memory_limit_mib()
    sizes = [
        ("the CR's status after the first plan", f["status_first_bytes"], limits.STATUS_ROOM),
        ("the CR's status at its largest", f["status_worst_bytes"], limits.STATUS_ROOM),
        ("the planner's memory ConfigMap, data", f["memory_configmap_data_bytes"], limits.CONFIGMAP_LIMIT),
        ("that memory decompressed (the operator reads no more)", f["memory_bytes"], MAX_MEMORY_BYTES),
        ("MULTIWORLD_WORLDS of the pod in most worlds", f["env_string_bytes"], limits.ENV_STRING_LIMIT),
        ("that pod's annotations", f["annotations_bytes"], limits.ANNOTATIONS_LIMIT),
        ("its worker's longest message to the operator", f["worker_line_bytes"], limits.MAX_LINE),
    ]
    body = [
        f"largest accepted spec (every cap of spec/limits.py at once, names of 63 characters): {f['pods']} pods, "
        f"{f['ranks']} ranks, {f['worlds']} worlds, a pod in {f['worlds_per_pod']} worlds; "
        f"the spec {f['spec_bytes'] / 1024:.1f} KiB as JSON\n"
        f"plan() on the first observation {common.fmt_s(first['wall_s'])} (CPU {common.fmt_s(first['cpu_s'])}), "
        f"on the failure of the pod in most worlds {common.fmt_s(failure['wall_s'])} "
        f"(CPU {common.fmt_s(failure['cpu_s'])}); Python's peak during a plan {f['plan_peak_mib']:.1f} MiB; "
        f"a process that imported the operator and made both plans: peak RSS {f['operator_rss_mib']:.0f} MiB",
        common.table(
            ["written for it", "KiB", "limit KiB", "of the limit"],
            [[what, f"{size / 1024:.1f}", f"{limit / 1024:g}", f"{size / limit:.0%}"] for what, size, limit in sizes],
        ),
        f"that memory holds {f['memory_values']} JSON values (the operator reads no more than {MAX_MEMORY_VALUES})\n"
        f"the status's limit: etcd's {limits.OBJECT_LIMIT // 1024} KiB object less a spec at its cap, "
        f"annotations at theirs and {limits.METADATA_ROOM // 1024} KiB of other metadata",
    ]
    targets = [
        common.Target("largest spec: plan on the first observation", first["wall_s"], limits.PLAN_LIMIT_S, " s"),
        common.Target("largest spec: plan on a failure", failure["wall_s"], limits.PLAN_LIMIT_S, " s"),
        common.Target(
            "largest spec: peak RSS of a process planning it (the chart's limit)",
            f["operator_rss_mib"],
            chart_mib,
            " MiB",
        ),
        *(common.Target(f"largest spec: {what}", size / 1024, limit / 1024, " KiB") for what, size, limit in sizes),
    ]
    return body, targets


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # First, alone: the API server and the operator would take CPU from the plans timed here.
    loaded = common.machine_load()
    largest = measure_largest()
    body: list[str] = []
    targets: list[common.Target] = []
    results: dict[str, Any] = {}
    if not args.largest:
        loaded, body, targets, results = cluster_figures(args)
    more_body, more_targets = largest_rows(largest)
    title = (
        "scale: the largest accepted spec"
        if args.largest
        else (
            "scale: a MultiWorld of many worlds, and many MultiWorlds (real kube-apiserver); the largest accepted spec"
        )
    )
    common.report(title, loaded, [*body, *more_body], [*targets, *more_targets])
    if args.json:
        common.json_line({**results, "largest": largest})
    return 0


if __name__ == "__main__":
    sys.exit(main())
