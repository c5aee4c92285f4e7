"""The webhook's certificate renewal on loopback, without a cluster: the server keeps serving
while its certificate changes, the API server's bundle holds the old and the new one before the
new one is served, and the old one only after."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from datetime import timedelta
from typing import Any

import multiworld_test_cluster as cluster_module  # registered by conftest.py
import pytest

from multiworld_operator.kube import webhook_tls
from multiworld_operator.kube.webhook_tls import AdmissionServer, CaBundle

RENEW_S = 1.0
PROPAGATION_S = 2.0


class Recorded(CaBundle):
    """The bundles the operator would write into the webhook configuration."""

    def __init__(self) -> None:
        super().__init__("recorded")
        self.bundles: list[bytes] = []

    async def publish(self, certificates: bytes) -> None:
        self.bundles.append(certificates)


async def no_review(request: Any, **_: Any) -> Any:
    raise AssertionError("no admission request is sent here")


async def served_certificate(port: int, trusted: bytes) -> bytes:
    """The certificate (DER) the server shows a client that trusts only `trusted` (PEM): an
    SSLCertVerificationError when it shows another."""
    context = ssl.create_default_context(cadata=trusted.decode())
    _, writer = await asyncio.open_connection("localhost", port, ssl=context)
    der: bytes = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    await writer.wait_closed()
    return der


def der(pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.decode())


async def published(bundle: Recorded, count: int) -> None:
    while len(bundle.bundles) < count:
        await asyncio.sleep(0.05)


def test_renewal_publishes_both_then_serves_the_new_then_drops_the_old(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(webhook_tls, "RENEW_EVERY", timedelta(seconds=RENEW_S))
    monkeypatch.setattr(webhook_tls, "PROPAGATION_S", PROPAGATION_S)
    port = cluster_module.free_port()
    bundle = Recorded()

    async def serve() -> None:
        # As kopf drives a webhook server: it asks for the next client config right away.
        async for _ in AdmissionServer(port, "webhook.ns.svc", bundle)(no_review):
            pass

    async def scenario() -> None:
        serving = asyncio.create_task(serve())
        try:
            await asyncio.wait_for(published(bundle, 1), 30)
            (first,) = bundle.bundles
            assert await served_certificate(port, first) == der(first)
            # Renewal: both published; the first still served until the propagation delay ends.
            await asyncio.wait_for(published(bundle, 2), 30)
            assert bundle.bundles[1].startswith(first)
            second = bundle.bundles[1][len(first) :]
            assert der(second) != der(first)
            assert await served_certificate(port, first) == der(first)
            await asyncio.wait_for(published(bundle, 3), 30)
            assert bundle.bundles[2] == second
            assert await served_certificate(port, second) == der(second)
            with pytest.raises(ssl.SSLCertVerificationError):
                await served_certificate(port, first)
        finally:
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving

    asyncio.run(scenario())
