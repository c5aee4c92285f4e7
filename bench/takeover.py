"""Two operator replicas with leader election against a real API server: how long the standby
takes to lead when the leader stops gracefully (SIGTERM: it releases the Lease) and when it is
killed (SIGKILL: the Lease must lapse), and how fast the new leader's first reaction is.

The scene is bench/operator_failures.py's (tests/support/operator_scene.py): its own control plane, the chart
installed for real (CRD, RBAC, the leader-election Role), a stand-in kubelet, and a star
MultiWorld of WORLDS worlds; the replicas are `multiworld operator --leader-election` processes
with the chart's ServiceAccount (tests/support/operator_support.py's OperatorReplica), on the Lease
named like the release. Each round starts two fresh replicas, waits until one holds the Lease
and the MultiWorld is Running, gives the standby STANDBY_WARM_S to start its watches, then:
- takeover_s: the clock starts just before the signal is sent to the leader's process, and
  stops when a read of the Lease (polled every POLL_S by the bench) first names the standby as
  its holder.
- first_react_s: right then, the bench marks world w0's exclusive pod Failed (the clock starts
  just before that status patch) and stops it when the replacement, stamped with w0's next
  epoch, is seen through the stand-in kubelet's watch: the new leader's first reaction, its
  reconcile loop started afresh (memory, table and pods read anew).
Between rounds both replicas are stopped and the Lease deleted, so that no round waits out the
last one's.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.support import bench_common as common
from tests.support.kubelet_stand_in import DESCRIBED, StandInKubelet
from tests.support.operator_scene import cluster_module, new_namespace, star, support, wait_for

FAULTS = {"graceful": signal.SIGTERM, "killed": signal.SIGKILL}
WORLDS = 2
POLL_S = 0.05
# Long enough for a fresh replica to import the operator and list the MultiWorlds.
STANDBY_WARM_S = 5.0
# A graceful handover waits for the standby's next look at the Lease (every 2 s at most).
GRACEFUL_LIMIT_S = 3.0


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.setting("--rounds", int, 3, 1, "takeovers timed per fault (graceful, killed)")
    p.setting("--lease-duration", int, 15, 15, "the Lease's duration, seconds (the chart's default)")
    return p.parse_args(argv)


@dataclass
class Scene:
    api: client.ApiClient
    release: Any  # operator_support.Release
    kube: Any  # operator_support.KubeNamespace
    kubelet: StandInKubelet
    directory: Path
    lease_duration_s: int
    loaded: str
    created: bool = False
    epoch: int = 1  # world w0's, which every round fails once


@contextmanager
def scene(directory: Path, lease_duration_s: int) -> Iterator[Scene]:
    cluster = cluster_module.Cluster(directory / "cluster")
    cluster.start(cluster_module.find_binaries(), detach=False)
    try:
        with cluster.api_client() as api:
            release = support.install_release(
                cluster, new_namespace(cluster, api, "mw-system"), support.WITHOUT_WEBHOOK
            )
            namespace = new_namespace(cluster, api, "bench")
            loaded = common.machine_load()
            with StandInKubelet(api, namespace) as kubelet:
                kube = support.KubeNamespace(api, namespace)
                yield Scene(api, release, kube, kubelet, directory, lease_duration_s, loaded)
    finally:
        cluster.stop()


def holder(scene: Scene) -> str | None:
    return support.lease_holder(scene.api, scene.release.namespace, scene.release.fullname)


def one_round(scene: Scene, fault: str) -> tuple[float, float]:
    """(takeover_s, first_react_s) of one takeover."""
    replicas = [
        support.OperatorReplica(
            scene.api,
            scene.release,
            scene.kube.namespace,
            scene.release.fullname,
            name,
            scene.directory / f"{name}.log",
            scene.lease_duration_s,
        )
        for name in (f"op-{uuid.uuid4().hex[:6]}-{role}" for role in "ab")
    ]
    try:
        names = {r.name: r for r in replicas}
        leader = wait_for("a replica to hold the Lease", lambda: names.get(holder(scene) or ""))
        (standby,) = [r for r in replicas if r is not leader]
        if not scene.created:
            scene.kube.create(star("mw", WORLDS))
            scene.created = True
        scene.kube.wait_running("mw", epochs={"w0": scene.epoch, **{f"w{i}": 1 for i in range(1, WORLDS)}})
        time.sleep(STANDBY_WARM_S)

        signalled = time.monotonic()
        leader.signal(FAULTS[fault])
        while holder(scene) != standby.name:
            if time.monotonic() - signalled > 10 * scene.lease_duration_s:
                raise cluster_module.ClusterError(f"the standby did not take over:\n{standby.log()[-3000:]}")
            time.sleep(POLL_S)
        takeover = time.monotonic() - signalled

        since = scene.kubelet.mark()
        failed = time.monotonic()
        scene.kubelet.fail("mw-m0-0")
        scene.epoch += 1
        replacement = scene.kubelet.wait_appeared("mw-m0-0", {"w0": scene.epoch}, since, 600.0)
        if fault == "graceful" and leader.wait() != 0:
            raise cluster_module.ClusterError(f"the leader did not stop cleanly:\n{leader.log()[-3000:]}")
        return takeover, replacement.at - failed
    finally:
        for replica in replicas:
            replica.close()
        try:
            client.CoordinationV1Api(scene.api).delete_namespaced_lease(scene.release.fullname, scene.release.namespace)
        except ApiException as error:
            if error.status != 404:
                raise


def render(samples: dict[str, list[tuple[float, float]]]) -> str:
    rows = []
    for fault, runs in samples.items():
        for what, values in (("takeover", [t for t, _ in runs]), ("first react", [r for _, r in runs])):
            spread = common.Spread.of(values)
            rows.append([fault, what, str(len(values)), *(common.fmt_s(v) for v in spread.as_dict().values())])
    return common.table(["leader", "figure", "rounds", "min", "median", "max"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    samples: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-takeover-") as directory:
        with scene(Path(directory), args.lease_duration) as the_scene:
            for fault in FAULTS:
                samples[fault] = [one_round(the_scene, fault) for _ in range(args.rounds)]
        loaded = the_scene.loaded
    takeover = {fault: common.Spread.of(t for t, _ in runs) for fault, runs in samples.items()}
    react = {fault: common.Spread.of(r for _, r in runs) for fault, runs in samples.items()}
    # A killed leader's Lease lapses `duration` after the standby last saw it renewed (every
    # 2 s), and the standby looks every 2 s.
    killed_limit = args.lease_duration + 4.0
    targets = [
        common.Target("graceful takeover, max", takeover["graceful"].max, GRACEFUL_LIMIT_S, " s"),
        common.Target("killed takeover, max", takeover["killed"].max, killed_limit, " s"),
    ]
    setup = (
        f"replicas: two `multiworld operator --leader-election --lease-duration {args.lease_duration}` "
        "processes, as the chart's ServiceAccount\n" + DESCRIBED
    )
    common.report(
        "operator: a standby's takeover, graceful (SIGTERM) and killed (SIGKILL) (real kube-apiserver)",
        loaded,
        [setup, render(samples)],
        targets,
    )
    if args.json:
        common.json_line(
            {
                "lease_duration_s": args.lease_duration,
                "takeover_s": {fault: spread.as_dict() for fault, spread in takeover.items()},
                "first_react_s": {fault: spread.as_dict() for fault, spread in react.items()},
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
