"""The Lease's rules (kube/leadership.py), pure: replicas against an in-memory Lease with
resourceVersions, no API server. One of two candidates leads; a standby waits out a live
holder's Lease and takes it no sooner than its duration after it last saw it change; a release
hands it over at once; a leader that finds someone else holding it, or cannot renew it in time,
steps down, takes its label off and reports the loss. Ceilings are generous: nothing here
measures a speed. And the replica's identity, and the command's flags."""

from __future__ import annotations

import asyncio
import copy
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pytest

from multiworld_operator.cli import main
from multiworld_operator.kube.leadership import LEADER_LABEL, Leadership, LeaseConfig

pytestmark = pytest.mark.quick

NAMESPACE, LEASE = "ops", "multiworld-operator"
CEILING_S = 15.0


class FakeApi:
    """One Lease, written only at the resourceVersion it has (else: someone else won), and the
    pods' labels. `unreachable`: every call fails as a lost connection would."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.labels: dict[str, dict[str, str]] = {}
        self.unreachable = False

    def _check(self) -> None:
        if self.unreachable:
            raise OSError("connection refused")

    def store(self, body: dict[str, Any]) -> dict[str, Any]:
        version = int((self.lease or {"metadata": {"resourceVersion": "0"}})["metadata"]["resourceVersion"]) + 1
        spec = {k: v for k, v in body["spec"].items() if v is not None}
        self.lease = {"metadata": {"name": LEASE, "resourceVersion": str(version)}, "spec": spec}
        return copy.deepcopy(self.lease)

    async def read_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._check()
        return copy.deepcopy(self.lease)

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None:
        self._check()
        return None if self.lease is not None else self.store(body)

    async def replace_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None:
        self._check()
        if self.lease is None or body["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            return None
        return self.store(body)

    async def label_pod(self, namespace: str, name: str, labels: Mapping[str, str | None]) -> dict[str, Any] | None:
        self._check()
        pod = self.labels.setdefault(name, {})
        for key, value in labels.items():
            if value is None:
                pod.pop(key, None)
            else:
                pod[key] = value
        return {"metadata": {"name": name, "labels": dict(pod)}}

    def holder(self) -> str | None:
        return (self.lease or {}).get("spec", {}).get("holderIdentity")

    def labelled(self) -> set[str]:
        return {pod for pod, labels in self.labels.items() if labels.get(LEADER_LABEL) == "true"}


class Replica:
    """An actor that notes what it was told, with its Leadership."""

    def __init__(self, api: FakeApi, identity: str, duration_s: int) -> None:
        self.leads = 0
        self.stepped_down = 0
        self.lost = 0
        self.told: list[str] = []
        config = LeaseConfig(NAMESPACE, LEASE, identity, duration_s, own_pod=(NAMESPACE, identity))
        self.leadership = Leadership(api, config, self, self._lost)

    async def lead(self, may_act: Callable[[], bool]) -> None:
        self.leads += 1
        self.told.append("lead" if may_act() else "lead, but may not act")

    async def step_down(self) -> None:
        self.stepped_down += 1
        self.told.append("step down")

    def _lost(self) -> None:
        self.lost += 1
        self.told.append("lost")


async def until(what: str, probe: Callable[[], bool], ceiling: float = CEILING_S) -> float:
    """Seconds until `probe()` holds."""
    started = time.monotonic()
    while not probe():
        assert time.monotonic() - started < ceiling, f"not within {ceiling} s: {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 4 * CEILING_S))


def test_one_of_two_leads_and_a_release_hands_over_at_once() -> None:
    async def scenario() -> None:
        api = FakeApi()
        api.labels["b"] = {LEADER_LABEL: "true"}  # left over from an earlier leader in this pod
        a, b = Replica(api, "a", 30), Replica(api, "b", 30)
        a.leadership.start()
        b.leadership.start()
        await until("a leader", lambda: api.holder() in ("a", "b") and a.leads + b.leads == 1)
        leader, standby = (a, b) if api.holder() == "a" else (b, a)
        await until("the leader's label, no other", lambda: api.labelled() == {api.holder()})
        await asyncio.sleep(5)  # renewals: the standby waits, however often it looks
        assert (standby.leads, leader.leads, leader.stepped_down) == (0, 1, 0)

        await leader.leadership.stop()
        assert leader.told == ["lead", "step down"]
        assert api.holder() is None  # released
        # Well within the 30 s duration: handed over, not waited out.
        await until("the standby to lead", lambda: standby.leads == 1, ceiling=15)
        await until("the label moved", lambda: api.labelled() == {standby.leadership.config.identity})
        await standby.leadership.stop()

    run(scenario)


def test_a_standby_takes_over_no_sooner_than_the_duration_after_the_last_renewal_it_saw() -> None:
    async def scenario() -> None:
        api = FakeApi()
        api.store({"spec": {"holderIdentity": "other", "leaseDurationSeconds": 3}})
        standby = Replica(api, "b", 3)
        standby.leadership.start()
        for _ in range(10):  # "other" renews for 5 s, longer than its duration
            await asyncio.sleep(0.5)
            assert api.lease is not None
            api.store(api.lease)
        renewed = time.monotonic()
        assert standby.leads == 0
        await until("the standby to take the lapsed Lease", lambda: standby.leads == 1)
        assert time.monotonic() - renewed >= 3
        assert api.holder() == "b" and api.lease is not None and api.lease["spec"]["leaseTransitions"] == 1
        await standby.leadership.stop()

    run(scenario)


def test_a_leader_that_finds_another_holder_steps_down() -> None:
    async def scenario() -> None:
        api = FakeApi()
        leader = Replica(api, "a", 30)
        leader.leadership.start()
        await until("a to lead", lambda: leader.leads == 1 and api.labelled() == {"a"})
        assert api.lease is not None
        api.store({**api.lease, "spec": {**api.lease["spec"], "holderIdentity": "intruder"}})
        await until("a to report the loss", lambda: leader.lost == 1)
        assert leader.told == ["lead", "step down", "lost"]
        assert not leader.leadership.may_act()
        assert api.labelled() == set() and api.holder() == "intruder"
        await leader.leadership.stop()  # kopf's cleanup after the loss: releases nothing
        assert api.holder() == "intruder" and leader.stepped_down == 1

    run(scenario)


def test_a_leader_that_cannot_renew_in_time_stops_acting() -> None:
    async def scenario() -> None:
        api = FakeApi()
        leader = Replica(api, "a", 3)  # renews every 0.6 s; its deadline is 2 s
        leader.leadership.start()
        await until("a to lead", lambda: leader.leads == 1)
        api.unreachable = True
        cut = time.monotonic()
        await until("a to stop acting", lambda: not leader.leadership.may_act())
        # No sooner than its deadline, and before the Lease could lapse for anyone else.
        assert 1.0 <= time.monotonic() - cut < 3
        await until("a to report the loss", lambda: leader.lost == 1)
        assert leader.told == ["lead", "step down", "lost"]
        await leader.leadership.stop()

    run(scenario)


def test_the_identity_is_the_pod_else_host_and_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "op-7d9f-x2")
    monkeypatch.setenv("POD_NAMESPACE", "ops")
    config = LeaseConfig.from_env(None, LEASE, 15)
    assert (config.namespace, config.identity, config.own_pod) == ("ops", "op-7d9f-x2", ("ops", "op-7d9f-x2"))
    # The chart's figures: renewed every 2 s, given up after 10 s.
    assert (config.renew_every_s, config.renew_deadline_s) == (2.0, 10.0)

    monkeypatch.delenv("POD_NAME")
    monkeypatch.delenv("POD_NAMESPACE")
    config = LeaseConfig.from_env("elsewhere", LEASE, 15)
    assert config.identity == f"{socket.gethostname()}-{os.getpid()}" and config.own_pod is None
    with pytest.raises(ValueError, match="--lease-namespace"):
        LeaseConfig.from_env(None, LEASE, 15)


def test_the_command_refuses_leader_election_without_a_namespace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    with pytest.raises(SystemExit) as refused:
        main(["operator", "--leader-election"])
    assert refused.value.code == 2
    assert "--lease-namespace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["operator", "--leader-election", "--lease-namespace", "ops", "--lease-duration", "2"])
    assert "must be >= 3" in capsys.readouterr().err
