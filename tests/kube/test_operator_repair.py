"""Repair, not reset (issue 21 items 5 and 6): what the operator wrote and someone deleted or
spoiled with the API is written again or rebuilt, never left to chance, and no running pod is
deleted for it.

- `kubectl delete cm -l multiworld.io/name=<mw>` cannot take the memory (labelled apart).
- A memory lost, or corrupt (not gzip; a gzip bomb), found when the operator starts is rebuilt
  from the pods' created-for stamps and the CR's status: every pod stays,
  each world keeps its epoch and restarts, and a Warning Event says so.
"""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from multiworld_operator.kube.memory.memory_store import MEMORY_REBUILT
from multiworld_operator.kube.memory.planner_memory import MAX_MEMORY_BYTES, MEMORY_KEY
from tests.cluster.cluster import Cluster
from tests.support.operator_support import (
    Kubelet,
    KubeNamespace,
    Scene,
    cluster_release,
    running_operator,
    two_worlds,
    wait_for,
)

pytestmark = pytest.mark.kube


def test_deleting_by_the_multiworld_label_leaves_the_memory(scene: Scene) -> None:
    """`kubectl delete cm -l multiworld.io/name=mw` cannot take the memory with it."""
    kube = scene.kube
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})
    memory: Any = kube.core.read_namespaced_config_map("mw", kube.namespace)
    kube.core.delete_collection_namespaced_config_map(kube.namespace, label_selector="multiworld.io/name=mw")
    after: Any = kube.core.read_namespaced_config_map("mw", kube.namespace)
    assert after.metadata.uid == memory.metadata.uid


# -- a memory lost or corrupt while the operator is down -------------------------------------


def _packed(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _plain_json(kube: KubeNamespace) -> None:
    """The memory as base64 of plain JSON (no gzip): BadGzipFile to the operator of before."""
    found: Any = kube.core.read_namespaced_config_map("mw", kube.namespace)
    memory = gzip.decompress(base64.b64decode(found.binary_data[MEMORY_KEY]))
    kube.core.patch_namespaced_config_map("mw", kube.namespace, {"binaryData": {MEMORY_KEY: _packed(memory)}})


def _gzip_bomb(kube: KubeNamespace) -> None:
    """A gzip of twice the bound (a few hundred KiB packed): decompressed whole, it would
    take that much memory of the operator."""
    bomb = gzip.compress(b" " * (2 * MAX_MEMORY_BYTES), compresslevel=9)
    kube.core.patch_namespaced_config_map("mw", kube.namespace, {"binaryData": {MEMORY_KEY: _packed(bomb)}})


def _stored_memory(kube: KubeNamespace) -> dict[str, Any] | None:
    """The memory as the operator stores it (labelled as the memory only), once it is again."""
    try:
        found: Any = kube.core.read_namespaced_config_map("mw", kube.namespace)
    except ApiException as error:
        if error.status == 404:
            return None  # not written yet
        raise
    if found.metadata.labels != {"multiworld.io/memory-of": "mw"}:
        return None
    try:
        memory: dict[str, Any] = json.loads(gzip.decompress(base64.b64decode(found.binary_data[MEMORY_KEY])))
    except (OSError, ValueError):
        return None
    return memory


def _deleted(kube: KubeNamespace) -> None:
    kube.core.delete_namespaced_config_map("mw", kube.namespace)


@pytest.mark.parametrize(
    ("spoil", "says"),
    [(_deleted, "is gone"), (_plain_json, "not gzip"), (_gzip_bomb, "larger than")],
    ids=["deleted", "plain-json", "gzip-bomb"],
)
def test_a_lost_or_corrupt_memory_is_rebuilt_without_deleting_a_pod(
    kube_cluster: Cluster,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    spoil: Callable[[KubeNamespace], None],
    says: str,
) -> None:
    """Once wa restarted (epoch 2, 1 restart), the operator stops and its memory is spoiled;
    the next operator rebuilds it: every pod stays, the epochs and restarts too, one Warning
    Event says why, and a later failure is recovered as usual (epoch 3, restart 2)."""
    kubeconfig = cluster_release(kube_cluster).operator_kubeconfig
    with kube_cluster.api_client() as api, Kubelet(api, namespace) as kubelet:
        _spoiled_and_rebuilt(
            KubeNamespace(api, namespace),
            kubelet,
            spoil,
            says,
            lambda: running_operator(kubeconfig, namespace, monkeypatch),
        )


def _spoiled_and_rebuilt(
    kube: KubeNamespace,
    kubelet: Kubelet,
    spoil: Callable[[KubeNamespace], None],
    says: str,
    operator: Callable[[], AbstractContextManager[object]],
) -> None:
    with operator():
        kube.create(two_worlds())
        kube.wait_running(epochs={"wa": 1, "wb": 1})
        kubelet.fail("mw-a-0")
        kube.wait_running(epochs={"wa": 2, "wb": 1})
    before = kube.uids()
    spoil(kube)

    with operator():
        rebuilt = wait_for("the rebuild announced", lambda: [e for e in kube.events() if e.reason == MEMORY_REBUILT])
        status = kube.wait_running(epochs={"wa": 2, "wb": 1})
        assert kube.uids() == before  # no pod deleted
        assert status["worlds"]["wa"]["restarts"] == 1 and status["restarts"] == 1
        assert len(rebuilt) == 1 and rebuilt[0].type == "Warning" and says in str(rebuilt[0].message), rebuilt
        memory = wait_for("the memory stored again", lambda: _stored_memory(kube))
        assert memory["worlds"]["wa"]["epoch"] == 2

        kubelet.fail("mw-b-0")
        status = kube.wait_running(epochs={"wa": 2, "wb": 2})
        assert status["restarts"] == 2
        after = kube.uids()
        assert after["mw-b-0"] != before["mw-b-0"]
        assert {p: u for p, u in after.items() if p != "mw-b-0"} == {p: u for p, u in before.items() if p != "mw-b-0"}
