"""Real API faults a step meets, made loud and bounded (issue 21): the operator's memory refused
(an immutable ConfigMap, a full ConfigMap quota), a ConfigMap written meanwhile by someone else
(a 409), a batch of requests one of which the API server refuses for its size, a pod delete an
admission webhook refuses. No mock: each
fault is the API server's own answer."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from multiworld_operator.kube.client.api import CONCURRENCY, KubeApi, gather_bounded
from multiworld_operator.kube.memory.planner_memory import MEMORY_KEY
from tests.cluster.cluster import Cluster
from tests.support.operator_support import KubeNamespace, Scene, two_worlds, wait_for
from tests.support.webhook_support import RefusingWebhook

pytestmark = pytest.mark.kube

QUOTA = "configmaps"
# Long enough for a few retries of a failed step (the backoff starts at 1 s and doubles).
RETRIES_S = 8.0


def _condition(status: dict[str, Any], type_: str) -> dict[str, str] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def _full_configmap_quota(kube: KubeNamespace) -> None:
    """A ResourceQuota that allows no more ConfigMaps than the namespace holds now; returns once
    the quota controller has counted them (before that, admission refuses every ConfigMap)."""
    count = len(kube.core.list_namespaced_config_map(kube.namespace).items)
    kube.core.create_namespaced_resource_quota(
        kube.namespace,
        client.V1ResourceQuota(
            metadata=client.V1ObjectMeta(name=QUOTA), spec=client.V1ResourceQuotaSpec(hard={"configmaps": str(count)})
        ),
    )

    def counted() -> bool:
        quota: Any = kube.core.read_namespaced_resource_quota(QUOTA, kube.namespace)
        return quota.status is not None and (quota.status.used or {}).get("configmaps") == str(count)

    wait_for("the ConfigMap quota counted", counted)


def test_a_refused_memory_write_deletes_nothing_and_shows_once(scene: Scene) -> None:
    """The operator's memory cannot be stored (someone made its ConfigMap immutable: the API
    server refuses every write of it, 422) when a pod fails: the failed pod is not deleted (the
    memory would not account for it), the MultiWorld says why in its Reconciled condition and in
    one Warning Event however often the step is retried, and once the ConfigMap goes the memory
    is written again, the world recovers and the condition goes."""
    kube = scene.kube
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})
    wait_for("the memory stored", lambda: kube.status().get("worldsReady") == "2/2")
    before = kube.uids()
    kube.core.patch_namespaced_config_map("mw", kube.namespace, {"immutable": True})

    scene.kubelet.fail("mw-a-0")

    def refused() -> dict[str, str] | None:
        condition = _condition(kube.status(), "Reconciled")
        return condition if condition is not None and condition["reason"] == "ApiError" else None

    condition = wait_for("the refused memory write in the status", refused)
    assert condition["status"] == "False", condition
    assert "ConfigMap mw" in condition["message"] and "422" in condition["message"], condition
    time.sleep(RETRIES_S)
    assert kube.uids() == before  # the failed pod is still there: nothing was deleted
    warnings = [e for e in kube.events() if e.reason == "ApiError"]
    assert len(warnings) == 1 and warnings[0].type == "Warning", warnings
    assert warnings[0].message == condition["message"]

    kube.core.delete_namespaced_config_map("mw", kube.namespace)
    status = kube.wait_running(epochs={"wa": 2, "wb": 1})
    assert kube.uids()["mw-a-0"] != before["mw-a-0"]
    wait_for("the Reconciled condition gone", lambda: _condition(kube.status(), "Reconciled") is None)
    assert status["worlds"]["wa"]["restarts"] == 1


def test_a_multiworld_whose_memory_cannot_be_created_says_why(scene: Scene) -> None:
    kube = scene.kube
    _full_configmap_quota(kube)
    kube.create(two_worlds())
    condition = wait_for("the refused memory write in the status", lambda: _condition(kube.status(), "Reconciled"))
    assert condition["status"] == "False" and condition["reason"] == "ApiError", condition
    assert "exceeded quota" in condition["message"], condition
    time.sleep(RETRIES_S)
    assert kube.pods() == {}  # nothing goes out before the memory
    assert [e.reason for e in kube.events() if e.type == "Warning"] == ["ApiError"]


def _edit_memory(kube: KubeNamespace, edit: Any) -> None:
    found: Any = kube.core.read_namespaced_config_map("mw", kube.namespace)
    memory = json.loads(gzip.decompress(base64.b64decode(found.binary_data[MEMORY_KEY])))
    edit(memory)
    packed = base64.b64encode(gzip.compress(json.dumps(memory).encode())).decode()
    kube.core.patch_namespaced_config_map("mw", kube.namespace, {"binaryData": {MEMORY_KEY: packed}})


def test_a_memory_written_meanwhile_is_read_again_not_overwritten(scene: Scene) -> None:
    """Someone else writes the operator's memory (another operator's step, say: here an edit that
    counts 40 restarts of world wa); the next write of this operator meets a 409, which ends its
    step: it reads the memory again and plans from it rather than overwriting it."""
    kube = scene.kube
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})
    wait_for("the memory stored", lambda: kube.status().get("worldsReady") == "2/2")

    def forty_restarts(memory: dict[str, Any]) -> None:
        memory["worlds"]["wa"]["restarts"] = 40

    _edit_memory(kube, forty_restarts)
    scene.kubelet.fail("mw-a-0")
    status = kube.wait_running(epochs={"wa": 2, "wb": 1})
    assert status["worlds"]["wa"]["restarts"] == 41, status["worlds"]["wa"]
    conflicts = wait_for("a Conflict event", lambda: [e for e in kube.events() if e.reason == "Conflict"])
    assert len(conflicts) == 1 and "ConfigMap mw" in str(conflicts[0].message), conflicts
    wait_for("the Reconciled condition gone", lambda: _condition(kube.status(), "Reconciled") is None)


def test_a_failed_call_of_a_batch_leaves_none_of_the_rest_running(kube_cluster: Cluster, namespace: str) -> None:
    """One create of a batch is refused (a ConfigMap over the API server's 1 MiB): no further
    call of the batch starts, and the ones in flight are done when gather_bounded raises."""
    calls = 20 * CONCURRENCY

    def configmap(index: int, size: int) -> dict[str, Any]:
        return {"metadata": {"name": f"cm-{index}"}, "data": {"x": "x" * size}}

    def count() -> int:
        listing: Any = core.list_namespaced_config_map(namespace)
        return len([cm for cm in listing.items if cm.metadata.name.startswith("cm-")])

    async def batch() -> tuple[int, int]:
        api = KubeApi(admin)
        bodies = [configmap(0, 1_100_000)] + [configmap(i, 10) for i in range(1, calls)]
        with pytest.raises(ApiException) as refused:
            await gather_bounded(api.write_configmap(namespace, body, None) for body in bodies)
        assert refused.value.status == 422, refused.value
        written = await asyncio.to_thread(count)
        await asyncio.sleep(3)  # the loop runs on: a call still running would land now
        return written, await asyncio.to_thread(count)

    with kube_cluster.api_client() as admin:
        core = client.CoreV1Api(admin)
        written, later = asyncio.run(batch())
    assert later == written < calls - 1


def test_a_pod_delete_refused_by_a_webhook_fails_the_step_loudly_until_it_passes(scene: Scene) -> None:
    """A failed pod's delete is refused by an admission webhook (a policy engine, say): the step
    fails, the MultiWorld says why in its Reconciled condition and in one Warning Event however
    often the step is retried, and the other world goes on untouched. Once the webhook lets deletes
    through, the retried step replaces the pod, the world recovers and the condition goes."""
    kube = scene.kube
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})
    before = kube.uids()
    with RefusingWebhook(kube.api, kube.namespace, "DELETE", "pods") as webhook:
        scene.kubelet.fail("mw-a-0")

        def refused() -> dict[str, str] | None:
            condition = _condition(kube.status(), "Reconciled")
            return condition if condition is not None and RefusingWebhook.MESSAGE in condition["message"] else None

        condition = wait_for("the refused delete in the status", refused)
        assert condition["status"] == "False" and condition["reason"] == "ApiError", condition
        assert "deleting pods" in condition["message"], condition
        wait_for("the step retried twice more", lambda: webhook.refused >= 3 or None)
        assert kube.uids()["mw-a-0"] == before["mw-a-0"]
        warnings = [e for e in kube.events() if e.type == "Warning" and e.reason == "ApiError"]
        assert len(warnings) == 1 and warnings[0].message == condition["message"], warnings
        assert kube.status()["worlds"]["wb"]["epoch"] == 1
        webhook.refusing = False
        status = kube.wait_running(epochs={"wa": 2, "wb": 1})
    assert kube.uids()["mw-a-0"] != before["mw-a-0"]
    assert {pod: uid for pod, uid in kube.uids().items() if pod != "mw-a-0"} == {
        pod: uid for pod, uid in before.items() if pod != "mw-a-0"
    }
    wait_for("the Reconciled condition gone", lambda: _condition(kube.status(), "Reconciled") is None)
    assert status["worlds"]["wa"]["restarts"] == 1
