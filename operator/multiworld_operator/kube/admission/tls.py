"""The admission webhook's TLS, with nothing to make or rotate by hand: every replica serves
the certificate of one Secret (certificate.py: made by the first replica, renewed by
whichever looks first), and keeps the chart's ValidatingWebhookConfiguration's `caBundle`
holding the bundle that Secret holds, so whichever replica the API server reaches shows a
certificate it trusts.

A replica writes the bundle before it listens: its port open (the chart's readiness probe) means
the API server can call it; where the bundle changed, it waits SETTLE_S more for the API server
to follow. It then reads the Secret every SYNC_S: it writes a bundle that changed, then serves
the certificate the Secret serves.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar, cast

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from multiworld_operator.kube.admission.certificate import SYNC_S, CertificatePair, Certificates, CertificateSecret
from multiworld_operator.kube.admission.serving import AdmissionSite
from multiworld_operator.kube.client.api import api_client
from multiworld_operator.kube.client.api_basics import REQUEST_TIMEOUT_S, Backoff

T = TypeVar("T")

log = logging.getLogger(__name__)

STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
# How long a replica that changed the bundle waits before it listens (the API server follows
# webhook configurations through a watch: moments).
SETTLE_S = 2.0
# How long a replica that stops goes on answering (see AdmissionServer).
DRAIN_S = 5.0


def load_pair(context: ssl.SSLContext, pair: CertificatePair) -> None:
    """Serve `pair` on `context` from the next handshake on (the ssl module reads only files;
    they live in /tmp for the moment it takes)."""
    with tempfile.TemporaryDirectory() as folder:
        certfile, keyfile = Path(folder) / "tls.crt", Path(folder) / "tls.key"
        certfile.write_bytes(pair[0])
        keyfile.write_bytes(pair[1])
        context.load_cert_chain(certfile, keyfile)


class CaBundle:
    """The `caBundle` of every webhook of one ValidatingWebhookConfiguration (the chart's)."""

    def __init__(self, configuration: str) -> None:
        self.configuration = configuration

    async def publish(self, certificates: bytes) -> bool:
        """Write the bundle, retrying until the API server takes it: until then it cannot call
        the webhook (failurePolicy decides what that means). Whether it changed."""
        return await self._retried(lambda: self._patch(base64.b64encode(certificates).decode()))

    async def owner_reference(self) -> client.V1OwnerReference:
        """An owner reference to the configuration (what the operator makes for it goes with it)."""
        return await self._retried(self._owner_reference)

    async def _retried(self, call: Callable[[], T]) -> T:
        backoff = Backoff(1.0, 30.0)
        while True:
            try:
                return await asyncio.to_thread(call)
            except (ApiException, HTTPError) as error:
                log.warning("cannot read or write %s: %s", self.configuration, error)
            await asyncio.sleep(backoff.next())

    def _owner_reference(self) -> client.V1OwnerReference:
        with api_client() as api:
            found = client.AdmissionregistrationV1Api(api).read_validating_webhook_configuration(
                self.configuration, _request_timeout=REQUEST_TIMEOUT_S
            )
        return client.V1OwnerReference(
            api_version="admissionregistration.k8s.io/v1",
            kind="ValidatingWebhookConfiguration",
            name=self.configuration,
            uid=cast(client.V1ObjectMeta, found.metadata).uid,
        )

    def _patch(self, encoded: str) -> bool:
        with api_client() as api:
            webhooks = client.AdmissionregistrationV1Api(api)
            current = webhooks.read_validating_webhook_configuration(
                self.configuration, _request_timeout=REQUEST_TIMEOUT_S
            )
            hooks = current.webhooks or []
            if all(hook.client_config.ca_bundle == encoded for hook in hooks):
                return False
            # A strategic merge patch merges the webhooks by name: only their caBundle changes,
            # whatever else the chart set.
            patch = {"webhooks": [{"name": hook.name, "clientConfig": {"caBundle": encoded}} for hook in hooks]}
            webhooks.patch_validating_webhook_configuration(
                self.configuration, patch, _content_type=STRATEGIC_MERGE_PATCH, _request_timeout=REQUEST_TIMEOUT_S
            )
        log.info("the caBundle of %s is current", self.configuration)
        return True


class ServedCertificate:
    """The certificate this replica's webhook serves, told to each follower as it changes: the
    metrics server (kube/metrics/server.py) shows the same one, which the chart's ServiceMonitor
    trusts through the Secret's bundle."""

    def __init__(self) -> None:
        self.pair: CertificatePair | None = None
        self._followers: list[Callable[[CertificatePair], None]] = []

    def follow(self, follower: Callable[[CertificatePair], None]) -> None:
        """Tell `follower` the certificate served now, if any, and every one after it."""
        self._followers.append(follower)
        if self.pair is not None:
            follower(self.pair)

    def serve(self, pair: CertificatePair) -> None:
        self.pair = pair
        for follower in self._followers:
            follower(pair)


class AdmissionServer:
    """`settings.admission.server`: kopf's server on `port` (every interface) with the
    certificate `secret` holds (for the name the API server calls it by, and for localhost: a
    caller on the same machine, an API server beside an operator run outside the cluster), its
    bundle kept in `bundle`; what it serves is told to `served`."""

    def __init__(
        self, port: int, bundle: CaBundle, secret: CertificateSecret, served: ServedCertificate | None = None
    ) -> None:
        self.port = port
        self.bundle = bundle
        self.secret = secret
        self.served = served or ServedCertificate()

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        owner = await self.bundle.owner_reference()
        held = await self._sync(owner)
        if await self.bundle.publish(held.bundle):
            await asyncio.sleep(SETTLE_S)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        load_pair(context, held.serving)
        site = AdmissionSite(fn, context)
        port = await site.start("", self.port)
        self.served.serve(held.serving)
        try:
            # Serving from here on; what the Secret serves next goes into the SSL context.
            yield kopf.WebhookClientConfig(url=f"https://{self.secret.hostnames[0]}:{port}")
            while True:
                await asyncio.sleep(SYNC_S)
                fresh = await self._sync(owner)
                if fresh.bundle != held.bundle:
                    await self.bundle.publish(fresh.bundle)
                if fresh.serving != held.serving:
                    load_pair(context, fresh.serving)
                    self.served.serve(fresh.serving)
                held = fresh
        finally:
            # A replica that stops is let go by its Service a moment later (the endpoints, then
            # every node's proxy): until then the API server's new connections still come here.
            await site.close(DRAIN_S)

    async def _sync(self, owner: client.V1OwnerReference) -> Certificates:
        """The Secret's certificates, retried until the API server answers."""
        backoff = Backoff(1.0, 30.0)
        while True:
            try:
                return await self.secret.sync(datetime.now(UTC), owner)
            except (ApiException, HTTPError) as error:
                log.warning("cannot read or write Secret %s/%s: %s", self.secret.namespace, self.secret.name, error)
            await asyncio.sleep(backoff.next())
