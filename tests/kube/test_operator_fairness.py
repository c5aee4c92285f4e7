"""One MultiWorld's work never stalls another's (issue 21, item 1): a small MultiWorld's failed
pod is replaced while the largest MultiWorld the spec accepts (every count cap at once: 512
worlds, 2048 ranks, 2048 pods, names of 63 characters) is still being created by the same
operator, whose planner runs off its event loop."""

from __future__ import annotations

import time
from typing import Any

import pytest

from multiworld_operator.spec.limits import MAX_PODS
from tests.support.limits_support import largest_manifest
from tests.support.operator_support import Scene, two_worlds, wait_for

pytestmark = pytest.mark.kube

LARGE_PODS = MAX_PODS
# Creating the large MultiWorld takes the test cluster a while (two shared cores).
LARGE_WAIT_S = 480.0


def large(namespace: str) -> dict[str, Any]:
    body = largest_manifest()
    body["metadata"] = {"name": body["metadata"]["name"], "namespace": namespace}
    return body


def test_a_small_multiworld_is_answered_while_a_large_one_is_created(scene: Scene) -> None:
    kube = scene.kube
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})
    before = kube.uids()
    body = large(kube.namespace)
    name = body["metadata"]["name"]
    kube.create(body)
    wait_for("the large MultiWorld's first pods", lambda: len(kube.pods(name)) >= 8)

    scene.kubelet.fail("mw-a-0")
    started = time.monotonic()
    # Answered: the replacement created (its being marked Running waits for the kubelet
    # stand-in, which has the large MultiWorld's pods to go through first).
    wait_for("mw-a-0 replaced", lambda: kube.uids().get("mw-a-0", before["mw-a-0"]) != before["mw-a-0"])
    answered = time.monotonic() - started
    large_phase = kube.status(name).get("phase")
    large_pods = len(kube.pods(name))
    assert large_phase != "Running" and large_pods < LARGE_PODS, (
        f"the large MultiWorld was {large_phase} with {large_pods} pods when the small one was answered "
        f"({answered:.1f}s)"
    )
    kube.wait_running(epochs={"wa": 2, "wb": 1})

    wait_for(
        "the large MultiWorld Running",
        lambda: kube.status(name).get("phase") == "Running",
        LARGE_WAIT_S,
    )
    assert len(kube.pods(name)) == LARGE_PODS
    print(f"small MultiWorld answered in {answered:.1f}s, the large one at {large_pods} of {LARGE_PODS} pods")
