"""The operator turns a MultiWorld into its pods and headless Service, reports status (with the
printer columns `kubectl get mw` shows) and Events, and deleting the MultiWorld deletes all of
it. The operator runs as the chart's ServiceAccount in every test (operator_support)."""

from __future__ import annotations

import json
import time

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.support import apiserver_requests
from tests.support.operator_support import (
    TWO_WORLDS_PODS,
    Scene,
    created_for,
    env_of,
    printer_columns,
    two_worlds,
    wait_for,
)

pytestmark = pytest.mark.kube

PODS = TWO_WORLDS_PODS


def gpu_template() -> dict:
    """A user template with its own labels, annotations, env (one clashing with the contract)
    and a GPU request, all of which the pods must keep."""
    return {
        "metadata": {"labels": {"team": "vision"}, "annotations": {"note": "kept"}},
        "spec": {
            "containers": [
                {
                    "name": "worker",
                    "image": "multiworld/worker:test",
                    "env": [{"name": "USER_SETTING", "value": "1"}, {"name": "MULTIWORLD_POD", "value": "wrong"}],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }


def test_pods_service_env_and_owner(scene: Scene) -> None:
    kube = scene.kube
    kube.create(two_worlds(template=gpu_template()))
    pods = kube.wait_pods(PODS)
    mw = kube.get()
    owner = (mw["metadata"]["uid"], "MultiWorld", "mw")

    for name, pod in pods.items():
        member, ordinal = name.removeprefix("mw-").rsplit("-", 1)
        assert pod.metadata.labels == {
            "team": "vision",
            "multiworld.io/name": "mw",
            "multiworld.io/member": member,
            "multiworld.io/ordinal": ordinal,
        }
        assert pod.metadata.annotations["note"] == "kept"
        [ref] = pod.metadata.owner_references
        assert (ref.uid, ref.kind, ref.name, ref.controller) == (*owner, True)
        assert (pod.spec.hostname, pod.spec.subdomain, pod.spec.restart_policy) == (name, "mw", "Never")
        assert pod.spec.containers[0].resources.limits == {"nvidia.com/gpu": "1"}
        env = env_of(pod)
        assert env["USER_SETTING"] == "1"
        assert (env["MULTIWORLD_POD"], env["MULTIWORLD_NAME"], env["MULTIWORLD_NAMESPACE"]) == (
            name,
            "mw",
            kube.namespace,
        )
        assert env["MULTIWORLD_TABLE"].startswith("operator://")
        # The token by which its worker proves its pod to the operator, and nothing else of the API.
        (token,) = [v for v in pod.spec.volumes if v.name == "multiworld-token"]
        (source,) = token.projected.sources
        assert source.service_account_token.audience == "multiworld.io"
        (container,) = pod.spec.containers
        assert [m.mount_path for m in container.volume_mounts if m.name == "multiworld-token"] == [
            "/var/run/secrets/multiworld.io"
        ]

    leader = {w["name"]: w for w in json.loads(env_of(pods["mw-leader-0"])["MULTIWORLD_WORLDS"])}
    assert set(leader) == {"wa", "wb"}
    for world in leader.values():
        assert (world["rank"], world["size"], world["epoch"]) == (0, 3, 1)
        assert world["host"] == "mw-leader-0.mw"
        assert world["backend"] == "nccl"  # every rank requests a GPU
    assert leader["wa"]["port"] != leader["wb"]["port"]  # one rank-0 pod hosts both stores
    [worker_world] = json.loads(env_of(pods["mw-b-1"])["MULTIWORLD_WORLDS"])
    assert (worker_world["name"], worker_world["rank"], worker_world["port"]) == ("wb", 2, leader["wb"]["port"])
    # Each world's store keys live under its secret at its epoch, handed to its members only
    # (issue 32, finding 5): the same for every member, another for every other world.
    assert worker_world["secret"] == leader["wb"]["secret"] != leader["wa"]["secret"]
    assert all(len(w["secret"]) == 32 for w in leader.values())
    assert created_for(pods["mw-leader-0"]) == {"wa": 1, "wb": 1}
    assert created_for(pods["mw-a-1"]) == {"wa": 1}

    service = kube.core.read_namespaced_service("mw", kube.namespace)
    assert service.spec.cluster_ip == "None"
    assert service.spec.publish_not_ready_addresses is True
    assert service.spec.selector == {"multiworld.io/name": "mw"}
    assert service.metadata.owner_references[0].uid == owner[0]


def test_status_printer_columns_and_events(scene: Scene) -> None:
    kube = scene.kube
    kube.create(two_worlds())
    status = kube.wait_running(epochs={"wa": 1, "wb": 1})

    assert status["worldsReady"] == "2/2"
    assert status["restarts"] == 0
    assert status["observedGeneration"] == 1
    for world in ("wa", "wb"):
        assert {k: status["worlds"][world][k] for k in ("phase", "size", "readyRanks", "restarts")} == {
            "phase": "Running",
            "size": 3,
            "readyRanks": 3,
            "restarts": 0,
        }
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"Ready": "True", "Degraded": "False"}
    table = kube.table()
    assert table["wa"]["pods"] == ["mw-leader-0", "mw-a-0", "mw-a-1"]
    assert table["wb"]["host"] == "mw-leader-0.mw"

    columns = printer_columns(kube.api, kube.namespace, "mw")
    assert (columns["Phase"], columns["Worlds"], columns["Restarts"]) == ("Running", "2/2", 0)
    assert wait_for("a WorldReady event per world", lambda: kube.event_reasons().count("WorldReady") == 2)

    # kopf keeps no state on the MultiWorld, so deleting it never waits for the operator.
    meta = kube.get()["metadata"]
    assert not meta.get("finalizers")
    assert not [k for k in meta.get("annotations") or {} if "kopf" in k]


def test_deleting_the_multiworld_deletes_everything(scene: Scene) -> None:
    kube = scene.kube
    kube.create(two_worlds())
    kube.wait_pods(PODS)
    wait_for("the Service", lambda: kube.core.list_namespaced_service(kube.namespace).items)

    kube.delete()
    kube.wait_pods(set())
    wait_for("the Service to be collected", lambda: not kube.core.list_namespaced_service(kube.namespace).items)
    with pytest.raises(ApiException) as gone:
        kube.get()
    assert gone.value.status == 404


def test_deleted_service_comes_back(scene: Scene) -> None:
    kube = scene.kube
    kube.create(two_worlds())
    [first] = wait_for("the Service", lambda: kube.core.list_namespaced_service(kube.namespace).items)

    kube.core.delete_namespaced_service(
        "mw", kube.namespace, _preload_content=False
    )  # (the client cannot parse the reply)
    wait_for(
        "a new Service",
        lambda: [
            s for s in kube.core.list_namespaced_service(kube.namespace).items if s.metadata.uid != first.metadata.uid
        ],
    )


# Services a tenant labels for its MultiWorld, created and deleted; how long the operator is
# watched for what it writes after.
DECOY_SERVICES = 20
DECOYS_WATCHED_S = 3.0


def test_a_deleted_service_not_its_own_costs_the_multiworld_nothing(scene: Scene) -> None:
    """Anyone who may write Services may label them for a MultiWorld: their deletions make the
    operator write nothing (only its own Service's comes back, test_deleted_service_comes_back)."""
    kube = scene.kube
    kube.create(two_worlds())
    wait_for("the Service", lambda: kube.core.list_namespaced_service(kube.namespace).items)
    before = apiserver_requests.scrape(kube.api)
    for i in range(DECOY_SERVICES):
        decoy = client.V1Service(
            metadata=client.V1ObjectMeta(name=f"decoy-{i}", labels={"multiworld.io/name": "mw"}),
            spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=80)]),
        )
        kube.core.create_namespaced_service(kube.namespace, decoy)
        kube.core.delete_namespaced_service(f"decoy-{i}", kube.namespace, _preload_content=False)
    time.sleep(DECOYS_WATCHED_S)
    posted = apiserver_requests.scrape(kube.api) - before
    created = ("POST", "services", "")
    # Each deletion made the operator try its own Service again (409) before.
    assert posted.without(created, "json", DECOY_SERVICES).by_kind()[created] == 0, posted.by_kind()


def test_resource_amounts_written_as_numbers_become_pods(scene: Scene) -> None:
    """`nvidia.com/gpu: 1` and `cpu: 0.5`, as people write them: the pods are created, with the
    amounts the API server understands."""
    template = {
        "spec": {
            "containers": [
                {
                    "name": "worker",
                    "image": "multiworld/worker:test",
                    "resources": {"limits": {"nvidia.com/gpu": 1, "cpu": 0.5}, "requests": {"cpu": 0.5}},
                }
            ]
        }
    }
    kube = scene.kube
    kube.create(two_worlds(template=template))
    pods = kube.wait_pods(PODS)
    limits = pods["mw-leader-0"].spec.containers[0].resources.limits
    assert limits == {"nvidia.com/gpu": "1", "cpu": "500m"}
