"""The webhook's certificate with several replicas (issue 32 finding 1), against a real API
server (the Secret, the webhook configuration's caBundle) and the replicas' real servers on
loopback: whichever replica a client reaches, it shows a certificate the caBundle the API server
holds trusts, from the moment the replica listens, through a replica's restart and through
renewals. Before, each replica made its own certificate and wrote it over the others' in the
caBundle: a client sent to any other replica met `x509: certificate signed by unknown
authority`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import pytest
from kubernetes import client
from kubernetes.config import kube_config

from multiworld_operator.kube.admission import certificate as webhook_secret, tls as webhook_tls
from multiworld_operator.kube.admission.certificate import CertificateSecret, secret_name
from multiworld_operator.kube.admission.tls import AdmissionServer, CaBundle
from tests.cluster import cluster as cluster_module
from tests.cluster.cluster import Cluster
from tests.support.webhook_support import ca_bundle

pytestmark = pytest.mark.kube

READY_S = 60.0
# A renewal every RENEW_S, each replica reading the Secret every SYNC_S: a look takes a good
# part of that on two busy cores (the operator's own is a minute; a look takes moments).
RENEW_S = 6.0
SYNC_S = 0.5


@pytest.fixture
def configuration(kube_cluster: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A ValidatingWebhookConfiguration of the test's own (for a resource nobody writes), and the
    operator's client pointed at the cluster as its admin."""
    monkeypatch.setenv("KUBECONFIG", str(kube_cluster.kubeconfig))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kube_cluster.kubeconfig))
    name = f"tls-{namespace}"
    rule = {"operations": ["CREATE"], "apiGroups": ["tls.test.invalid"], "apiVersions": ["v1"], "resources": ["x"]}
    body: Any = {  # a body as JSON, which the client takes for its model
        "metadata": {"name": name},
        "webhooks": [{
            "name": "tls.test.multiworld.io",
            "clientConfig": {"url": "https://localhost:1/spec"},
            "rules": [rule],
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "failurePolicy": "Ignore",
        }],
    }  # fmt: skip
    with kube_cluster.api_client() as api:
        webhooks = client.AdmissionregistrationV1Api(api)
        webhooks.create_validating_webhook_configuration(body)
        try:
            yield name
        finally:
            webhooks.delete_validating_webhook_configuration(name)


async def no_review(request: Any, **_: Any) -> Any:
    raise AssertionError("no admission request is sent here")


@contextlib.asynccontextmanager
async def replica(port: int, namespace: str, configuration: str) -> AsyncIterator[None]:
    """One operator replica's webhook server, as kopf drives it (it asks for the next client
    config right away), serving until the block ends."""
    secret = CertificateSecret(namespace, secret_name(configuration), ["localhost"])
    server = AdmissionServer(port, CaBundle(configuration), secret)

    async def serve() -> None:
        async for _ in server(no_review):
            pass

    task = asyncio.create_task(serve())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def listening(port: int) -> None:
    """Until the port takes connections (the chart's readiness probe)."""
    async with asyncio.timeout(READY_S):
        while True:
            try:
                _, writer = await asyncio.open_connection("localhost", port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            writer.close()
            return


def trusted(api: client.ApiClient, configuration: str) -> bytes:
    """The certificates the API server trusts for the webhook (its caBundle), PEM."""
    bundle = ca_bundle(api, configuration)
    assert bundle is not None
    return base64.b64decode(bundle)


async def served_certificate(port: int, bundle: bytes) -> bytes:
    """The certificate (DER) a replica shows a client that trusts only `bundle`: an
    SSLCertVerificationError when it shows another."""
    context = ssl.create_default_context(cadata=bundle.decode())
    _, writer = await asyncio.open_connection("localhost", port, ssl=context)
    der: bytes = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    with contextlib.suppress(ssl.SSLError, ConnectionError):
        await writer.wait_closed()
    return der


def test_every_replica_serves_a_certificate_the_ca_bundle_trusts(
    kube_cluster: Cluster, namespace: str, configuration: str
) -> None:
    """Two replicas started together, one restarted: each, once listening, shows the one
    certificate of the Secret (owned by the configuration), which the caBundle holds."""
    ports = [cluster_module.free_port(), cluster_module.free_port()]

    async def scenario(api: client.ApiClient) -> None:
        async with replica(ports[0], namespace, configuration), replica(ports[1], namespace, configuration):
            await asyncio.gather(*(listening(port) for port in ports))
            bundle = trusted(api, configuration)
            first = {await served_certificate(port, bundle) for port in ports}
            assert len(first) == 1
        async with replica(ports[1], namespace, configuration):  # a restart: the same certificate
            await listening(ports[1])
            assert trusted(api, configuration) == bundle
            assert {await served_certificate(ports[1], bundle)} == first

    with kube_cluster.api_client() as api:
        asyncio.run(scenario(api))
        secret: Any = client.CoreV1Api(api).read_namespaced_secret(secret_name(configuration), namespace)
        (owner,) = secret.metadata.owner_references
        assert (owner.kind, owner.name) == ("ValidatingWebhookConfiguration", configuration)


def test_through_renewals_every_replica_stays_trusted(
    kube_cluster: Cluster, namespace: str, configuration: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal every few seconds, two replicas: at every moment each shows a certificate the
    caBundle the API server holds trusts, the bundle holds two certificates at most, and the
    certificate served changes."""
    monkeypatch.setattr(webhook_secret, "RENEW_EVERY", timedelta(seconds=RENEW_S))
    monkeypatch.setattr(webhook_secret, "PROPAGATION_S", 1.0)
    monkeypatch.setattr(webhook_secret, "SYNC_S", SYNC_S)
    monkeypatch.setattr(webhook_tls, "SYNC_S", SYNC_S)
    ports = [cluster_module.free_port(), cluster_module.free_port()]

    async def scenario(api: client.ApiClient) -> tuple[set[bytes], int]:
        seen: set[bytes] = set()
        most = 0  # certificates in the bundle at most
        async with replica(ports[0], namespace, configuration), replica(ports[1], namespace, configuration):
            await asyncio.gather(*(listening(port) for port in ports))
            loop = asyncio.get_running_loop()
            until = loop.time() + 3 * RENEW_S
            while loop.time() < until:
                bundle = trusted(api, configuration)
                served = {await served_certificate(port, bundle) for port in ports}
                seen |= served
                most = max(most, bundle.count(b"BEGIN CERTIFICATE"))
                await asyncio.sleep(0.1)
        return seen, most

    with kube_cluster.api_client() as api:
        seen, most = asyncio.run(scenario(api))
    assert len(seen) >= 2 and most == 2, (len(seen), most)
