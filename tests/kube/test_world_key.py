"""The key of every world's secrets (issue 32 finding 5; kube/workers/world_key.py), against a real API
server: replicas that start together, and a replica that restarts, read one key, so a world's
secret at an epoch is the same whichever replica hands it and after a restart; the chart's empty
Secret is filled, a missing one made, and one that holds no key refuses to start the operator."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.config import kube_config

from multiworld_operator.kube.workers.world_key import DATA_KEY, ENV_WORLD_KEY_SECRET, world_key
from multiworld_operator.world_secrets import KEY_BYTES, WorldSecrets
from tests.cluster.cluster import Cluster

pytestmark = pytest.mark.kube

REPLICAS = 4


@pytest.fixture
def core(kube_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[client.CoreV1Api]:
    """The operator's client pointed at the cluster as its admin, and one for the test."""
    monkeypatch.setenv("KUBECONFIG", str(kube_cluster.kubeconfig))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kube_cluster.kubeconfig))
    with kube_cluster.api_client() as api:
        yield client.CoreV1Api(api)


def environ(namespace: str, name: str) -> dict[str, str]:
    return {ENV_WORLD_KEY_SECRET: name, "POD_NAMESPACE": namespace}


async def replicas(namespace: str, name: str) -> list[bytes]:
    return await asyncio.gather(*(world_key(environ(namespace, name)) for _ in range(REPLICAS)))


def stored(core: client.CoreV1Api, namespace: str, name: str) -> bytes:
    return base64.b64decode(core.read_namespaced_secret(name, namespace).data[DATA_KEY])


def test_replicas_started_together_and_a_restart_read_one_key(core: client.CoreV1Api, namespace: str) -> None:
    name = "mw-world-key"
    core.create_namespaced_secret(namespace, client.V1Secret(metadata=client.V1ObjectMeta(name=name), type="Opaque"))
    keys = asyncio.run(replicas(namespace, name))
    assert len(set(keys)) == 1 and len(keys[0]) == KEY_BYTES, keys
    assert stored(core, namespace, name) == keys[0]
    restarted = asyncio.run(world_key(environ(namespace, name)))
    assert restarted == keys[0]
    scope = f"{namespace}/mw/uid"
    assert WorldSecrets(restarted, scope).secret("w", 7) == WorldSecrets(keys[-1], scope).secret("w", 7)


def test_a_missing_secret_is_made_and_one_without_a_key_is_refused(core: client.CoreV1Api, namespace: str) -> None:
    keys = asyncio.run(replicas(namespace, "made-by-the-operator"))
    assert len(set(keys)) == 1 and stored(core, namespace, "made-by-the-operator") == keys[0]
    junk = client.V1Secret(
        metadata=client.V1ObjectMeta(name="junk"), type="Opaque", data={DATA_KEY: base64.b64encode(b"short").decode()}
    )
    core.create_namespaced_secret(namespace, junk)
    with pytest.raises(ValueError, match="holds no world key"):
        asyncio.run(world_key(environ(namespace, "junk")))
    assert base64.b64decode(core.read_namespaced_secret("junk", namespace).data[DATA_KEY]) == b"short"  # untouched
