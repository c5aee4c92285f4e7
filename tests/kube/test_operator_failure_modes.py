"""Failure modes that used to be silent or to churn, each made loud and bounded, against the real
API server: values at the edge of the schema, duplicate names, an unexpected error in a step."""

from __future__ import annotations

import pytest
from kubernetes.client.rest import ApiException

from tests.support.operator_support import KubeNamespace, Scene, two_worlds, wait_for

pytestmark = pytest.mark.kube


def _condition(status: dict[str, object], type_: str) -> dict[str, str] | None:
    conditions = status.get("conditions") or []
    assert isinstance(conditions, list)
    return next((c for c in conditions if c["type"] == type_), None)


def test_durations_beyond_the_maximum_are_refused_by_field(scene: Scene) -> None:
    kube = scene.kube
    body = two_worlds(policy={"window": "10000000d", "backoff": {"maxDelay": "400d"}})
    kube.create(body)
    status = wait_for("the spec refused", lambda: (c := _condition(kube.status(), "SpecValid")) and c)
    assert status["status"] == "False"
    for field in ("spec.worlds[0].failurePolicy.window", "spec.worlds[0].failurePolicy.backoff.maxDelay"):
        assert field in status["message"], status["message"]
    assert "maximum duration, 366d" in status["message"]
    assert kube.pods() == {}


def test_the_api_server_refuses_numbers_beyond_the_maximum(scene: Scene) -> None:
    for policy, field in (({"backoff": {"factor": 1e40}}, "factor"), ({"maxRestarts": 10**9}, "maxRestarts")):
        with pytest.raises(ApiException) as refused:
            scene.kube.create(two_worlds(policy=policy))
        assert refused.value.status == 422 and field in refused.value.body, refused.value.body


@pytest.mark.parametrize("field", ["members", "worlds"])
def test_duplicate_names_are_refused_naming_the_field_and_create_nothing(scene: Scene, field: str) -> None:
    """The lists are atomic for the API server (per-item field tracking would outgrow the object
    at thousands of worlds), so the controller refuses duplicates."""
    kube = scene.kube
    body = two_worlds()
    body["spec"][field].append(dict(body["spec"][field][-1]))
    kube.create(body)
    refusal = wait_for("the spec refused", lambda: (c := _condition(kube.status(), "SpecValid")) and c)
    assert refusal["status"] == "False" and "declared twice" in refusal["message"], refusal
    assert f"spec.{field}[" in refusal["message"], refusal
    assert kube.pods() == {} and kube.table() == {}


def test_an_unexpected_error_in_a_step_shows_in_status_and_an_event(scene: Scene) -> None:
    """A template Kubernetes would refuse, which the spec check does not read (containers is not
    a list): the step fails where it builds the pods; status and an Event say how."""
    kube = scene.kube
    kube.create(two_worlds(template={"spec": {"containers": "worker"}}))
    condition = wait_for("the failed step in the status", lambda: _condition(kube.status(), "Reconciled"))
    assert condition["status"] == "False" and condition["reason"] == "ReconcileError"
    assert condition["message"].startswith("reconcile step failed: AttributeError"), condition
    events = wait_for("a ReconcileError event", lambda: [e for e in kube.events() if e.reason == "ReconcileError"])
    assert len(events) == 1 and events[0].type == "Warning" and events[0].message == condition["message"]


def _wait_refused(kube: KubeNamespace, name: str, text: str) -> dict[str, str]:
    def refused() -> dict[str, str] | None:
        condition = _condition(kube.status(name), "Reconciled")
        return condition if condition is not None and text in condition["message"] else None

    condition = wait_for(f"{name}: the taken name in its status", refused)
    assert condition["status"] == "False" and condition["reason"] == "CreateRefused", condition
    events = wait_for(
        f"{name}: a CreateRefused event",
        lambda: [e for e in kube.events(name) if e.reason == "CreateRefused" and text in e.message],
    )
    assert len(events) == 1 and events[0].type == "Warning", events
    return condition


def test_a_pod_name_taken_by_another_multiworld_is_left_alone_and_reported(scene: Scene) -> None:
    """MultiWorld `a` with member `b-c` and MultiWorld `a-b` with member `c` both name a pod
    a-b-c-0: the second one does not take it, and says whose it is."""
    from tests.support.operator_support import manifest

    kube = scene.kube
    kube.create(manifest("a-b", {"c": 2}, {"w": ["c"]}))
    kube.wait_running("a-b", epochs={"w": 1})
    theirs = kube.uids("a-b")
    kube.create(manifest("a", {"b-c": 1, "d": 1}, {"w": ["b-c", "d"]}))
    _wait_refused(kube, "a", "pod a-b-c-0 already exists and is not this MultiWorld's (owned by MultiWorld a-b)")
    assert kube.uids("a-b") == theirs
    assert kube.status("a-b")["phase"] == "Running"


def test_a_foreign_service_of_the_same_name_is_left_alone_and_reported(scene: Scene) -> None:
    from kubernetes import client

    kube = scene.kube
    kube.core.create_namespaced_service(
        kube.namespace,
        client.V1Service(
            metadata=client.V1ObjectMeta(name="mw"), spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=80)])
        ),
    )
    kube.create(two_worlds())
    _wait_refused(kube, "mw", "Service mw already exists and is not this MultiWorld's (it has no owner)")
    service = kube.core.read_namespaced_service("mw", kube.namespace)
    assert service.spec.cluster_ip != "None" and not service.metadata.owner_references  # untouched


def test_the_rendezvous_is_closed_to_other_pods_by_a_network_policy(scene: Scene) -> None:
    """Each MultiWorld's pods admit their own MultiWorld's pods on any port and anyone on the
    ports the templates declare; spec.networkPolicy: false removes the policy."""
    from kubernetes import client

    kube = scene.kube
    template = {
        "spec": {
            "containers": [
                {
                    "name": "worker",
                    "image": "multiworld/worker:test",
                    "ports": [{"containerPort": 8000}, {"containerPort": 9000, "protocol": "UDP"}],
                }
            ]
        }
    }
    kube.create(two_worlds(template=template))

    def policy() -> client.V1NetworkPolicy | None:
        return kube.network_policy()

    found = wait_for("the NetworkPolicy mw", policy)
    ours = {"multiworld.io/name": "mw"}
    assert found.metadata.owner_references[0].uid == kube.get()["metadata"]["uid"]
    assert found.spec.pod_selector.match_labels == ours and found.spec.policy_types == ["Ingress"]
    peers, served = found.spec.ingress
    assert [p.pod_selector.match_labels for p in peers._from] == [ours] and peers.ports is None
    assert served._from is None and [(p.port, p.protocol) for p in served.ports] == [(8000, "TCP"), (9000, "UDP")]

    spec = two_worlds(template=template)["spec"]
    spec["networkPolicy"] = False
    kube.patch_spec("mw", spec)
    wait_for("the NetworkPolicy gone", lambda: policy() is None)
