"""An in-memory platform for driving the pure planner in tests: it keeps pods as a platform
would (created Pending, deleted on request), lets a test fail, delete, start or finish them,
and replans. It holds no decisions of its own."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from multiworld.contract import BrokenWorldReport
from multiworld_operator.planner import (
    MultiWorldStatus,
    Observation,
    Plan,
    PodObservation,
    PodPhase,
    plan,
)
from multiworld_operator.spec import MultiWorld, parse_manifest

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def endpoint(world: str, rank0_pod: str) -> tuple[str, int]:
    return f"{rank0_pod}.svc", 29500


def make(members: list[dict[str, Any]], worlds: list[dict[str, Any]], name: str = "mw", **spec: Any) -> MultiWorld:
    return parse_manifest(
        {
            "apiVersion": "multiworld.io/v1alpha1",
            "kind": "MultiWorld",
            "metadata": {"name": name, "generation": 1},
            "spec": {
                "template": {"spec": {"containers": [{"name": "c", "image": "x"}]}},
                "members": members,
                "worlds": worlds,
                **spec,
            },
        }
    )


def seed_topology(**world_extra: Any) -> MultiWorld:
    """leader is rank 0 of world1 (with w1 x2) and world2 (with w2)."""
    return make(
        [{"name": "leader"}, {"name": "w1", "replicas": 2}, {"name": "w2"}],
        [
            {"name": "world1", "ranks": ["leader", "w1"], **world_extra},
            {"name": "world2", "ranks": ["leader", "w2"], **world_extra},
        ],
    )


class Sim:
    def __init__(self, mw: MultiWorld, now: datetime = T0) -> None:
        self.mw = mw
        self.now = now
        self.pods: dict[str, PodObservation] = {}
        self.status: MultiWorldStatus | None = None
        self.reports: list[BrokenWorldReport] = []
        self.last: Plan | None = None
        # Pods whose process is frozen: Running, but their worker follows no table.
        self.frozen: set[str] = set()
        # Nodes the platform found lost lately, and when.
        self.lost_nodes: dict[str, datetime] = {}

    # -- the platform side ------------------------------------------------------------------

    def observation(self) -> Observation:
        return Observation(
            now=self.now, pods=list(self.pods.values()), reports=list(self.reports), lost_nodes=dict(self.lost_nodes)
        )

    def plan(self) -> Plan:
        self.last = plan(self.mw, self.status, self.observation(), endpoint=endpoint)
        return self.last

    def execute(self, result: Plan) -> None:
        for delete in result.deletes:
            self.pods.pop(delete.pod, None)
        for create in result.creates:
            if create.pod not in self.pods:
                self.pods[create.pod] = PodObservation(
                    name=create.pod,
                    member=create.member,
                    ordinal=create.ordinal or 0,
                    phase="Pending",
                    created_for=create.created_for,
                )
        self.status = result.status
        # A live worker that follows the table starts joining each newer epoch of its worlds.
        for name, pod in list(self.pods.items()):
            if pod.phase == "Running" and pod.joined is not None and name not in self.frozen:
                joining = {
                    a.name: a.epoch
                    for a in self.status.table.assignments_for(name).values()
                    if pod.joined.get(a.name) != a.epoch
                }
                self.pods[name] = pod.model_copy(update={"joining": joining})

    def step(self) -> Plan:
        result = self.plan()
        self.execute(result)
        return result

    # -- what happens to pods ---------------------------------------------------------------

    def set_phase(self, pod: str, phase: PodPhase) -> None:
        self.pods[pod] = self.pods[pod].model_copy(update={"phase": phase})

    def start_all(self) -> None:
        """Every Pending pod runs and joins the epochs of the current table; a warm spare that
        plays nothing waits for an identity."""
        assert self.status is not None
        for name, pod in list(self.pods.items()):
            if pod.phase in ("Pending", "Running") and name not in self.frozen:
                joined = {a.name: a.epoch for a in self.status.table.assignments_for(name).values()}
                warm = name in self.status.spare_pool
                self.pods[name] = pod.model_copy(
                    update={"phase": "Running", "joined": joined, "joining": {}, "warm": warm}
                )

    def fail(self, pod: str) -> None:
        self.set_phase(pod, "Failed")

    def vanish(self, pod: str) -> None:
        del self.pods[pod]

    def report(
        self, world: str, epoch: int, pod: str = "", peer_rank: int | None = None, reason: str = "peer timed out"
    ) -> None:
        self.reports.append(
            BrokenWorldReport(world=world, epoch=epoch, reason=reason, pod=pod, peer_rank=peer_rank, time=self.now)
        )

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def settle(self, rounds: int = 6) -> Plan:
        """Plan, execute and start pods until a plan asks for nothing more."""
        result = self.step()
        for _ in range(rounds):
            self.start_all()
            result = self.step()
            if not (result.creates or result.deletes):
                return result
        raise AssertionError(f"did not settle: {result.actions}")

    # -- reading the status -----------------------------------------------------------------

    def epoch(self, world: str) -> int:
        assert self.status is not None
        return self.status.worlds[world].epoch

    def world_phase(self, world: str) -> str:
        assert self.status is not None
        return self.status.worlds[world].phase
