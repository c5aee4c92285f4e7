"""The operator's log follows one failure by its keys (issue 35 item 7): on a real API server, a
failed pod's world is broken, its pod replaced and the world restarted; every line of that
MultiWorld's loop and its step carries `multiworld`, and its Events' lines the world and its
epoch."""

from __future__ import annotations

import logging

import pytest

from multiworld_operator.log_context import ContextFilter
from tests.support.operator_support import Scene, two_worlds

pytestmark = pytest.mark.kube


def test_a_failure_is_logged_under_its_multiworld_and_world(scene: Scene, caplog: pytest.LogCaptureFixture) -> None:
    kube = scene.kube
    caplog.handler.addFilter(ContextFilter())
    with caplog.at_level(logging.INFO, logger="multiworld_operator"):
        caplog.clear()  # the operator's start-up lines are about no MultiWorld
        kube.create(two_worlds())
        kube.wait_running(epochs={"wa": 1, "wb": 1})
        scene.kubelet.fail("mw-a-0")
        kube.wait_running(epochs={"wa": 2, "wb": 1})
    # What the loop and its step say: not what the operator says of itself when the first
    # MultiWorld starts it (the world key, the worker channel's address).
    loop = ("controller", "reconcile", "reporting", "memory", "objects", "client")
    ours = [
        r
        for r in caplog.records
        if r.name.startswith(tuple(f"multiworld_operator.kube.{m}" for m in loop))
        and not r.getMessage().startswith("worker channel listening")
    ]
    bound = {getattr(r, "multiworld", None) for r in ours}
    assert bound == {f"{kube.namespace}/mw"}, [(r.getMessage(), getattr(r, "multiworld", None)) for r in ours]
    deletes = [r.getMessage() for r in ours if r.getMessage().startswith("deleting pod mw-a-0")]
    assert deletes, [r.getMessage() for r in ours]
    about_wa = {
        r.getMessage().split(":")[0]: getattr(r, "epoch", None) for r in ours if getattr(r, "world", None) == "wa"
    }
    # The failure's line carries the epoch wa restarts at, as its recovery's does.
    assert {"Warning WorldFailed": 2, "Normal WorldRecovered": 2}.items() <= about_wa.items(), about_wa
    assert not [r.getMessage() for r in ours if getattr(r, "world", None) == "wb" and "WorldFailed" in r.getMessage()]
