"""What one MultiWorld's Events may cost the cluster, on a real API server: a workload that
fails again and again (a tenant's crash loop, a flood of refused reports) posts a burst of Events,
then one per refill; what was held back is said once, in the next Event the budget allows."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from kubernetes import client

from multiworld_operator.kube.client.api import KubeApi
from multiworld_operator.kube.reporting import events
from multiworld_operator.kube.reporting.events import EVENT_BURST, SUPPRESSED, MultiWorldEvents
from tests.cluster.cluster import Cluster

# Short, so that the test sees a refill; the posts of a burst take far less on any machine.
REFILL_S = 3.0
POSTS = 2 * EVENT_BURST


def test_a_multiworld_posts_a_burst_of_events_then_says_what_it_held_back(
    kube_cluster: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events, "EVENT_REFILL_S", REFILL_S)
    multiworld: dict[str, Any] = {"metadata": {"name": "mw", "namespace": namespace, "uid": str(uuid.uuid4())}}

    def posted() -> list[Any]:
        with kube_cluster.api_client() as api:
            listing: Any = client.CoreV1Api(api).list_namespaced_event(namespace)
        mine = [e for e in listing.items if e.involved_object.uid == multiworld["metadata"]["uid"]]
        return mine

    async def scenario() -> float:
        with kube_cluster.api_client() as api:
            said = MultiWorldEvents(KubeApi(api), multiworld)
            started = time.monotonic()
            for n in range(POSTS):
                await said.post("Warning", "WorldFailed", f"failure {n}")
            took = time.monotonic() - started
            await asyncio.sleep(REFILL_S)
            await said.post("Normal", "WorldRecovered", "back")
            return took

    took = asyncio.run(scenario())
    said = posted()
    refills = int(took / REFILL_S) + 1
    failures = {e.message for e in said if e.reason == "WorldFailed"}
    assert EVENT_BURST <= len(failures) <= EVENT_BURST + refills, (len(failures), took)
    assert failures == {f"failure {n}" for n in range(len(failures))}  # the first ones
    (summary,) = [e for e in said if e.reason == SUPPRESSED]
    assert summary.type == "Warning"
    assert summary.message.startswith(f"{POSTS - len(failures)} WorldFailed not posted in the last "), summary.message
    assert [e.message for e in said if e.reason == "WorldRecovered"] == ["back"]
    assert len(said) == len(failures) + 2


def test_a_large_multiworlds_start_leaves_its_failures_their_events(kube_cluster: Cluster, namespace: str) -> None:
    """A MultiWorld of many worlds says WorldReady for each, and its first failures are still
    posted: the burst grows with the worlds."""
    worlds = 128
    multiworld: dict[str, Any] = {"metadata": {"name": "big", "namespace": namespace, "uid": str(uuid.uuid4())}}

    async def scenario() -> None:
        with kube_cluster.api_client() as api:
            said = MultiWorldEvents(KubeApi(api), multiworld)
            said.allow_for(worlds)
            for n in range(worlds):
                await said.post("Normal", "WorldReady", f"world w{n} ready")
            for reason in ("WorldFailed", "WorldRestarting", "WorldRecovered"):
                await said.post("Normal", reason, "world w0")

    asyncio.run(scenario())
    with kube_cluster.api_client() as api:
        listing: Any = client.CoreV1Api(api).list_namespaced_event(namespace)
    reasons = [e.reason for e in listing.items if e.involved_object.uid == multiworld["metadata"]["uid"]]
    assert reasons.count("WorldReady") == worlds, reasons
    assert {"WorldFailed", "WorldRestarting", "WorldRecovered"} <= set(reasons), reasons
    assert SUPPRESSED not in reasons
