"""The admission webhook's TLS, with nothing to make or rotate by hand: the operator makes a
self-signed certificate when it starts and a new one every RENEW_EVERY while it runs, and keeps
the chart's ValidatingWebhookConfiguration's `caBundle` holding it. The key never leaves the
process (no Secret holds it).

A renewal publishes the old and the new certificate together first and serves the new one only
PROPAGATION_S later, so the API server trusts whichever it is shown meanwhile; then the old one
is dropped from the bundle.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import logging
import ssl
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import cast

import kopf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes import client
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from multiworld_operator.kube.api import api_client
from multiworld_operator.kube.api_basics import REQUEST_TIMEOUT_S, Backoff

log = logging.getLogger(__name__)

CERT_VALIDITY = timedelta(days=90)
RENEW_EVERY = timedelta(days=30)
# The API server follows webhook configurations through a watch: a new bundle reaches it in
# moments, well within this.
PROPAGATION_S = 30.0
# The certificate's start is backdated by this much, for clocks a little behind ours.
CLOCK_SKEW = timedelta(minutes=5)
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"

CertificatePair = tuple[bytes, bytes]  # (certificate, private key), PEM


def self_signed(hostnames: Sequence[str], now: datetime) -> CertificatePair:
    """A certificate for `hostnames` (DNS names or IP addresses), signed by its own key: the API
    server trusts it as the bundle's only CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for hostname in hostnames:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(hostname)))
        except ValueError:
            names.append(x509.DNSName(hostname))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostnames[0])])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + CERT_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem


def _load(context: ssl.SSLContext, pair: CertificatePair) -> None:
    """Serve `pair` on `context` from the next handshake on (the ssl module reads only files;
    they live in /tmp for the moment it takes)."""
    with tempfile.TemporaryDirectory() as folder:
        certfile, keyfile = Path(folder) / "tls.crt", Path(folder) / "tls.key"
        certfile.write_bytes(pair[0])
        keyfile.write_bytes(pair[1])
        context.load_cert_chain(certfile, keyfile)


class _Server(kopf.WebhookServer):
    """kopf's webhook server with the certificate it is given: kopf's own self-signed one needs
    certbuilder, whose oscrypto cannot read the version of OpenSSL 3.0.10 and later."""

    def __init__(self, pair: CertificatePair, *, port: int, host: str, context: ssl.SSLContext) -> None:
        super().__init__(port=port, host=host, context=context)
        self._pair = pair

    # kopf calls it on the server (self.build_certificate) when it has no certificate files; a
    # static method there, as it makes one from nothing.
    def build_certificate(  # type: ignore[override]
        self, hostnames: Collection[str], password: str | None = None
    ) -> CertificatePair:
        return self._pair


class CaBundle:
    """The `caBundle` of every webhook of one ValidatingWebhookConfiguration (the chart's)."""

    def __init__(self, configuration: str) -> None:
        self.configuration = configuration

    async def publish(self, certificates: bytes) -> None:
        """Write the bundle, retrying until the API server takes it: until then it cannot call
        the webhook (failurePolicy decides what that means)."""
        backoff = Backoff(1.0, 30.0)
        while True:
            try:
                await asyncio.to_thread(self._patch, base64.b64encode(certificates).decode())
                return
            except (ApiException, HTTPError) as error:
                log.warning("cannot write the caBundle of %s: %s", self.configuration, error)
            await asyncio.sleep(backoff.next())

    def _patch(self, encoded: str) -> None:
        with api_client() as api:
            webhooks = client.AdmissionregistrationV1Api(api)
            current = webhooks.read_validating_webhook_configuration(
                self.configuration, _request_timeout=REQUEST_TIMEOUT_S
            )
            # A strategic merge patch merges the webhooks by name: only their caBundle changes,
            # whatever else the chart set.
            hooks = current.webhooks or []
            patch = {"webhooks": [{"name": hook.name, "clientConfig": {"caBundle": encoded}} for hook in hooks]}
            webhooks.patch_validating_webhook_configuration(
                self.configuration, patch, _content_type=STRATEGIC_MERGE_PATCH, _request_timeout=REQUEST_TIMEOUT_S
            )
        log.info("the caBundle of %s is current", self.configuration)


class AdmissionServer:
    """`settings.admission.server`: kopf's server on `port` (every interface), its certificate,
    kept in `bundle`, for `host` (the name the API server calls it by) and for localhost (a
    caller on the same machine: an API server beside an operator run outside the cluster)."""

    def __init__(self, port: int, host: str, bundle: CaBundle) -> None:
        self.port = port
        self.hostnames = [host, "localhost"]
        self.bundle = bundle

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        pair = self_signed(self.hostnames, datetime.now(UTC))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server = _Server(pair, port=self.port, host=self.hostnames[0], context=context)
        # An async generator (kopf types it as an iterator): closed with this one, it stops serving.
        serving = cast("AsyncGenerator[kopf.WebhookClientConfig, None]", server(fn))
        async with contextlib.aclosing(serving) as configs:
            # Serving from here on. kopf's server yields again only when its certificate files
            # change, and it has none: renewals go straight into its SSL context instead.
            config = await anext(configs)
            await self.bundle.publish(pair[0])
            yield config
            while True:
                await asyncio.sleep(RENEW_EVERY.total_seconds())
                renewed = self_signed(self.hostnames, datetime.now(UTC))
                await self.bundle.publish(pair[0] + renewed[0])
                await asyncio.sleep(PROPAGATION_S)
                _load(context, renewed)
                pair = renewed
                await self.bundle.publish(pair[0])
