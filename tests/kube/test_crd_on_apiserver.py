"""The generated CRD on a real kube-apiserver (1.20): accepted as structural, defaults applied,
bad values refused, the planner's status stored without pruning, printer columns shown."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from multiworld_operator.crd import crd
from multiworld_operator.planner import merge_patch
from multiworld_operator.spec import parse_manifest
from tests.cluster import cluster as cluster_module
from tests.support.planner_sim import Sim

pytestmark = pytest.mark.kube

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "multiworld.io", "v1alpha1", "multiworlds"
NAMESPACE = "default"
ESTABLISH_TIMEOUT_S = 30.0
LIST_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[client.ApiClient]:
    """A control plane with the generated CRD installed and established."""
    try:
        binaries = cluster_module.find_binaries()
        cluster = cluster_module.Cluster(tmp_path_factory.mktemp("crd-cluster"))
        cluster.start(binaries, detach=False)
    except cluster_module.ClusterError as error:
        pytest.fail(f"the test Kubernetes control plane is not available: {error}", pytrace=False)
    try:
        with cluster.api_client() as api_client:
            extensions = client.ApiextensionsV1Api(api_client)
            extensions.create_custom_resource_definition(crd())  # type: ignore[arg-type]  # a dict body, sent as is
            cluster_module.wait_for(
                "the MultiWorld CRD to be established", lambda: _established(extensions), ESTABLISH_TIMEOUT_S
            )
            yield api_client
    finally:
        cluster.stop()


def _established(extensions: client.ApiextensionsV1Api) -> bool | None:
    found = extensions.read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    assert found.status is not None
    return any(c.type == "Established" and c.status == "True" for c in found.status.conditions or []) or None


# Every manifest of the examples (their paths under examples/), variants included.
EXAMPLE_MANIFESTS = sorted(
    str(p.relative_to(REPO / "examples")) for p in (REPO / "examples").glob("*/multiworld*.yaml")
)


def _example(name: str, example: str = "all_gather") -> dict[str, Any]:
    body = yaml.safe_load((REPO / "examples" / example / "multiworld.yaml").read_text())
    body["metadata"]["name"] = name
    return body


def _create(api: client.ApiClient, body: dict[str, Any]) -> dict[str, Any]:
    created = client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)
    return cast("dict[str, Any]", created)  # the custom resource, as JSON


def _patch_status(api: client.ApiClient, name: str, status: dict[str, Any]) -> dict[str, Any]:
    patched = client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        GROUP, VERSION, NAMESPACE, PLURAL, name, {"status": status}
    )
    return cast("dict[str, Any]", patched)  # the custom resource, as JSON


def _get(api: client.ApiClient, path: str, accept: str = "application/json") -> Any:
    method, url, headers, _, _ = api.param_serialize(
        "GET", path, header_params={"Accept": accept}, auth_settings=["BearerToken"]
    )
    response = api.call_api(method, url, headers)
    return json.loads(response.read())


def test_short_name_and_status_subresource_are_served(api: client.ApiClient) -> None:
    resources = {r["name"]: r for r in _get(api, f"/apis/{GROUP}/{VERSION}")["resources"]}
    assert resources[PLURAL]["shortNames"] == ["mw"] and resources[PLURAL]["namespaced"]
    assert f"{PLURAL}/status" in resources


def test_server_defaults_agree_with_the_models(api: client.ApiClient) -> None:
    body = _example("defaults")
    body["spec"]["worlds"][0]["failurePolicy"] = {"maxRestarts": 3}
    stored = _create(api, body)
    assert stored["spec"]["members"][0] == {"name": "leader", "replicas": 1, "spares": 0}
    assert stored["spec"]["worlds"][0]["failurePolicy"] == {
        "maxRestarts": 3,
        "window": "1h",
        "replace": "Pod",
        "joinTimeout": "5m",
    }
    assert parse_manifest(stored).spec == parse_manifest(body).spec


def test_server_refuses_bad_values_naming_the_field(api: client.ApiClient) -> None:
    body = _example("refused")
    body["spec"]["members"][0]["replicas"] = 0
    body["spec"]["worlds"][0]["name"] = "Bad_Name"
    body["spec"]["worlds"][1]["failurePolicy"] = {"window": "an hour"}
    with pytest.raises(ApiException) as refused:
        _create(api, body)
    assert refused.value.body is not None
    message = json.loads(refused.value.body)["message"]
    for field in ("spec.members.replicas", "spec.worlds.name", "spec.worlds.failurePolicy.window"):
        assert field in message, message


def test_planner_status_view_is_stored_unpruned_and_merge_patches_clear_fields(api: client.ApiClient) -> None:
    stored = _create(api, _example("status"))
    sim = Sim(parse_manifest(stored))
    sim.settle()
    pod = "status-w2-0"
    sim.fail(pod)
    sim.settle()
    sim.fail(pod)  # the second failure within the window waits for its backoff
    waiting = sim.step().status
    assert waiting.worlds["world2"].restart_at is not None
    written = _patch_status(api, "status", {**waiting.view(), "kopf": {"progress": {}}})
    assert "kopf" in written["status"]  # room for other controllers' bookkeeping
    assert {k: v for k, v in written["status"].items() if k != "kopf"} == waiting.view()

    sim.advance(waiting.worlds["world2"].restart_at.timestamp() - sim.now.timestamp())
    restarted = sim.step().status
    written = _patch_status(api, "status", merge_patch(waiting.view(), restarted.view()))
    assert "restartAt" not in written["status"]["worlds"]["world2"]
    assert {k: v for k, v in written["status"].items() if k != "kopf"} == restarted.view()
    # The status is one field for server-side field tracking, however many worlds it holds.
    owned = [json.dumps(m.get("fieldsV1", {})) for m in written["metadata"]["managedFields"]]
    assert not any('"f:world1"' in fields for fields in owned), owned


def test_printer_columns_show_phase_worlds_and_restarts(api: client.ApiClient) -> None:
    stored = _create(api, _example("columns"))
    sim = Sim(parse_manifest(stored))
    sim.settle()
    sim.fail("columns-w1-0")
    _patch_status(api, "columns", sim.step().status.view())
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io"

    def row() -> list[Any] | None:  # a list may be served from the watch cache a moment behind
        table = _get(api, path, accept)
        columns = [(c["name"], c["priority"]) for c in table["columnDefinitions"]]
        assert columns == [("Name", 0), ("Phase", 0), ("Worlds", 0), ("Restarts", 0), ("Updated", 0), ("Age", 0),
                           ("Health", 1), ("Rollout", 1)]  # fmt: skip
        cells = next((r["cells"] for r in table["rows"] if r["cells"][0] == "columns"), None)
        return cells if cells and cells[1] else None

    cells = cluster_module.wait_for("the columns MultiWorld in a table listing", row, LIST_TIMEOUT_S)
    assert cells[1:4] == ["Recovering", "1/2", 1]
    assert cells[6] == "not healthy: world1", cells  # -o wide


@pytest.mark.parametrize("example", EXAMPLE_MANIFESTS)
def test_every_example_manifest_is_accepted_unchanged(api: client.ApiClient, example: str) -> None:
    """What `kubectl apply -f examples/<name>/multiworld.yaml` sends: stored as written."""
    body = yaml.safe_load((REPO / "examples" / example).read_text())
    stored = _create(api, body)
    members = [(m["name"], m.get("replicas", 1)) for m in body["spec"]["members"]]
    assert [(m["name"], m["replicas"]) for m in stored["spec"]["members"]] == members
    assert [w["ranks"] for w in stored["spec"]["worlds"]] == [w["ranks"] for w in body["spec"]["worlds"]]
    assert stored["spec"]["template"] == body["spec"]["template"]


def test_every_example_has_a_manifest() -> None:
    programs = sorted(p.parent.name for p in (REPO / "examples").glob("*/main.py"))
    assert sorted({Path(m).parent.name for m in EXAMPLE_MANIFESTS}) == programs
