"""The operator against a real API server: how fast a failed pod is replaced, and how many API
writes one world failure costs as a MultiWorld grows.

The bench starts its own control plane (etcd, kube-apiserver, kube-controller-manager; see
tests/cluster/cluster.py) in a temp dir, installs the chart (CRD and RBAC, cluster-wide), and
runs the operator (`multiworld operator --namespace NS`) as a process of its own, with the
chart's ServiceAccount token (`--as admin`: the cluster admin's). There is no kubelet: a
stand-in in this process watches the pods, marks each new one Running kubelet_stand_in.START_S after it
appears, and marks a pod Failed on request, both by status patches as a kubelet would; it counts
its own writes.

- react: from a pod marked Failed (the clock starts before the patch is sent) to its
  replacement existing at the new epoch (its created-for annotation, seen through a watch).
  A MultiWorld of 2 worlds [leader, m<i>]; the exclusive pods fail in turn.
- writes per failure: every write the API server counts (apiserver_request_total, write verbs,
  every client) from the failure until the world is back (Running at the new epoch, its
  WorldRecovered Event posted) and the API is quiet, minus the stand-in kubelet's own writes.
  MultiWorlds of 2, 16 and 128 worlds, each world [leader, m<i>] with one exclusive pod
  m<i>-0, which fails. Beside them: react at each size, and the API server's own time per
  write request (apiserver_request_duration_seconds), which show where a larger MultiWorld's
  failure spends its time.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from tests.support import bench_common as common
from tests.support.apiserver_requests import Kind, Writes, label, scrape
from tests.support.kubelet_stand_in import DESCRIBED
from tests.support.operator_scene import Scene, fail_and_recover, scene, start, wait_for

WORLD_COUNTS = (2, 16, 128)
REACT_WORLDS = 2
REACT_LIMIT_S = 0.3
# A real kubelet needs at least this long to start a container. It also keeps the operator's
# step that sees a new pod apart from the step that sees it Running, so the write count does
# not depend on whether the operator happens to see both in one listing.
# The API is quiet when no write was counted for this long.
QUIET_S = 1.0
# What the stand-in kubelet writes: pod status patches, from the Python client.
KUBELET_WRITE: Kind = ("PATCH", "pods", "status")
KUBELET_ENCODING = "json"


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.setting("--failures", int, 20, 3, "pod failures timed for react")
    p.setting("--repeats", int, 3, 1, "world failures counted per MultiWorld size")
    common.credentials_flag(p)
    return p.parse_args(argv)


# ---- one failure -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FailureCost:
    react_s: float
    requests: Writes  # every write the API server served meanwhile, the stand-in kubelet's included
    kubelet_writes: int

    @property
    def writes(self) -> Writes:
        """The writes the failure cost: the stand-in kubelet's own left out."""
        return self.requests.without(KUBELET_WRITE, KUBELET_ENCODING, self.kubelet_writes)


def quiet_writes(api: client.ApiClient) -> Writes:
    """The API server's write totals once no write happened for QUIET_S: a failure's trailing
    writes land before the count, and the next failure starts from a still API."""
    previous = scrape(api)

    def still() -> Writes | None:
        nonlocal previous
        time.sleep(QUIET_S)
        now = scrape(api)
        settled, previous = now.counts == previous.counts, now
        return now if settled else None

    return wait_for(f"the API server to see no write for {QUIET_S:g} s", still)


def fail_once(scene: Scene, name: str, index: int) -> FailureCost:
    """Fail world w<index>'s exclusive pod; return once the world is back at its next epoch and
    the API is quiet again."""
    before = quiet_writes(scene.api)
    kubelet_before = scene.kubelet.writes
    react_s = fail_and_recover(scene, name, index)
    requests = quiet_writes(scene.api) - before
    return FailureCost(react_s, requests, scene.kubelet.writes - kubelet_before)


# ---- figures -----------------------------------------------------------------------------------


def mean_writes(runs: list[FailureCost]) -> float:
    return statistics.mean(c.writes.total() for c in runs)


def render_react(samples: list[float]) -> str:
    row = [
        str(len(samples)),
        common.fmt_s(statistics.median(samples)),
        common.fmt_s(common.p99(samples)),
        common.fmt_s(min(samples)),
        common.fmt_s(max(samples)),
    ]
    return (
        f"react: pod marked Failed -> its replacement exists at the new epoch ({REACT_WORLDS} worlds)\n"
        + common.table(["failures", "median", "p99", "min", "max"], [row])
    )


def render_writes(costs: dict[int, list[FailureCost]]) -> str:
    kinds = sorted({k for runs in costs.values() for c in runs for k in c.writes.by_kind()}, key=label)
    rows = []
    for worlds, runs in costs.items():
        totals = [c.writes.total() for c in runs]
        rows.append(
            [
                str(worlds),
                str(len(runs)),
                f"{mean_writes(runs):.2f}",
                f"{min(totals)}-{max(totals)}",
                f"{statistics.mean(c.writes.by_encoding('json') for c in runs):.2f}",
                f"{statistics.mean(c.writes.by_encoding('protobuf') for c in runs):.2f}",
                *(f"{statistics.mean(c.writes.by_kind()[k] for c in runs):.2f}" for k in kinds),
            ]
        )
    return (
        "API writes per world failure, mean (every client; the stand-in kubelet's left out; "
        "json: the operator, protobuf: kube-controller-manager)\n"
        + common.table(["worlds", "failures", "writes", "min-max", "json", "protobuf", *map(label, kinds)], rows)
    )


def render_timing(costs: dict[int, list[FailureCost]]) -> str:
    """Where a failure's time goes as worlds grow: react, and the API server's time per write."""
    kinds = sorted({k for runs in costs.values() for c in runs for k in c.writes.by_kind()}, key=label)
    rows = []
    for worlds, runs in costs.items():
        cells = []
        for kind in kinds:
            count = sum(c.requests.by_kind()[kind] for c in runs)
            cells.append(common.fmt_s(sum(c.requests.seconds[kind] for c in runs) / count) if count else "-")
        rows.append([str(worlds), common.fmt_s(statistics.median(c.react_s for c in runs)), *cells])
    return "react, and the API server's time per write request, mean\n" + common.table(
        ["worlds", "react (median)", *map(label, kinds)], rows
    )


# ---- the run -----------------------------------------------------------------------------------


def measure(scene: Scene, args: Any) -> tuple[list[float], dict[int, list[FailureCost]]]:
    start(scene, "react", REACT_WORLDS)
    react = [fail_once(scene, "react", i % REACT_WORLDS).react_s for i in range(args.failures)]
    costs: dict[int, list[FailureCost]] = {}
    for worlds in WORLD_COUNTS:
        name = f"star{worlds}"
        start(scene, name, worlds)
        costs[worlds] = [fail_once(scene, name, r % worlds) for r in range(args.repeats)]
    return react, costs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="bench-operator-") as directory,
        scene(Path(directory), args.credentials) as the_scene,
    ):
        react, costs = measure(the_scene, args)
        credentials, loaded = the_scene.credentials, the_scene.loaded
    writes = {worlds: mean_writes(runs) for worlds, runs in costs.items()}
    smallest, largest = min(WORLD_COUNTS), max(WORLD_COUNTS)
    targets = [
        common.Target("react median", statistics.median(react), REACT_LIMIT_S, " s"),
        common.Target(
            f"writes per failure, |{largest} worlds - {smallest} worlds|", abs(writes[largest] - writes[smallest]), 0.0
        ),
    ]
    setup = f"operator: `multiworld operator` in its own process, as {credentials}\n{DESCRIBED}"
    common.report(
        "operator: failure reaction and API writes per world failure (real kube-apiserver)",
        loaded,
        [setup, render_react(react), render_writes(costs), render_timing(costs)],
        targets,
    )
    if args.json:
        common.json_line(
            {
                "react_s": {"median": statistics.median(react), "p99": common.p99(react)},
                "writes_per_failure": {str(worlds): value for worlds, value in writes.items()},
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
