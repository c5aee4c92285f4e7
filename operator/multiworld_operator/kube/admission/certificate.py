"""The admission webhook's certificate, one for every replica: kept in a Secret beside the
webhook's Service (`secret_name`), made by whichever replica finds none first (a create: of
replicas racing, one makes it and the others read what it made), owned by the webhook
configuration (deleted with the release). Every replica serves what the Secret holds, so the
caBundle trusts whichever replica the Service sends the API server to.

The Secret holds the certificate served (tls.crt, tls.key), the bundle of every certificate a
replica may still serve (ca.crt), and during a renewal the next certificate (next.crt,
next.key). A renewal is two steps, each taken by whichever replica looks first (every
SYNC_S), each an update at the resourceVersion it read (of replicas racing, one wins and the
others read it again):
- RENEW_EVERY after the served certificate was made: a next one, in the bundle beside it (the
  one served before it leaves the bundle then: every replica has served the current one for
  most of RENEW_EVERY);
- PROPAGATION_S after that (the API server holds the bundle by then): the next one is served,
  the one before stays in the bundle.
A replica writes the bundle the Secret holds before it serves the certificate it read with it.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes import client
from kubernetes.client.rest import ApiException

from multiworld_operator.kube.client.api import api_client
from multiworld_operator.kube.client.raced_secret import RacedSecret

CERT_VALIDITY = timedelta(days=90)
RENEW_EVERY = timedelta(days=30)
# The API server follows webhook configurations through a watch: a new bundle reaches it in
# moments, well within this.
PROPAGATION_S = 30.0
# How often a replica reads the Secret (to serve what it holds, and take a renewal's step due).
SYNC_S = 60.0
# Reads and writes before a replica gives up a sync (other replicas kept winning the race).
ATTEMPTS = 5
# The certificate's start is backdated by this much, for clocks a little behind ours.
CLOCK_SKEW = timedelta(minutes=5)

CertificatePair = tuple[bytes, bytes]  # (certificate, private key), PEM


def self_signed(hostnames: Sequence[str], now: datetime) -> CertificatePair:
    """A certificate for `hostnames` (DNS names or IP addresses), signed by its own key: the API
    server trusts it as a CA of the bundle."""
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
        # Each certificate names its key: during a renewal the bundle holds two of one subject,
        # and a client (OpenSSL) picks the issuer by these, not by the name alone.
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem


def secret_name(configuration: str) -> str:
    """The Secret of the webhook whose configuration is named `configuration`."""
    return f"{configuration}-webhook-tls"


def secret_namespace(host: str, environ: Mapping[str, str] = os.environ) -> str:
    """Where the Secret lives: the operator's own namespace (POD_NAMESPACE, from the downward
    API), else the one the webhook's host names (`<service>.<namespace>.svc`, as the chart
    gives it)."""
    namespace = environ.get("POD_NAMESPACE") or (host.split(".")[1] if host.count(".") >= 1 else "")
    if not namespace:
        raise ValueError(
            "the webhook's certificate needs a namespace: $POD_NAMESPACE, or a host "
            f"<service>.<namespace>.svc, not {host!r}"
        )
    return namespace


@dataclass(frozen=True)
class Certificates:
    """What the Secret holds: the pair served, the bundle (PEM, the served one among them) and
    the next pair during a renewal."""

    serving: CertificatePair
    bundle: bytes
    next: CertificatePair | None = None

    def step(self, now: datetime) -> Certificates | None:
        """The renewal's step due at `now` (the module's docstring), if one is."""
        if self.next is not None:
            if _age(self.next, now) >= timedelta(seconds=PROPAGATION_S):
                return Certificates(self.next, self.next[0] + self.serving[0])
            return None
        if _age(self.serving, now) >= RENEW_EVERY:
            fresh = self_signed(_hostnames(self.serving), now)
            return replace(self, bundle=self.serving[0] + fresh[0], next=fresh)
        return None

    def data(self) -> dict[str, str]:
        files = {"tls.crt": self.serving[0], "tls.key": self.serving[1], "ca.crt": self.bundle}
        if self.next is not None:
            files.update({"next.crt": self.next[0], "next.key": self.next[1]})
        return {key: base64.b64encode(value).decode() for key, value in files.items()}

    @classmethod
    def from_data(cls, data: Mapping[str, str]) -> Certificates:
        files = {key: base64.b64decode(value) for key, value in data.items()}
        following = (files["next.crt"], files["next.key"]) if "next.crt" in files else None
        return cls((files["tls.crt"], files["tls.key"]), files["ca.crt"], following)


def _age(pair: CertificatePair, now: datetime) -> timedelta:
    made = x509.load_pem_x509_certificate(pair[0]).not_valid_before_utc + CLOCK_SKEW
    return now - made


def _hostnames(pair: CertificatePair) -> list[str]:
    names = x509.load_pem_x509_certificate(pair[0]).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    return [str(name.value) for name in names.value]


class CertificateSecret:
    """The Secret `name` in `namespace`, for certificates of `hostnames`."""

    def __init__(self, namespace: str, name: str, hostnames: Sequence[str]) -> None:
        self.namespace, self.name = namespace, name
        self.hostnames = list(hostnames)

    async def sync(self, now: datetime, owner: client.V1OwnerReference | None) -> Certificates:
        """What the Secret holds once this replica took the step due (made it, with `owner` as
        its owner reference, or a renewal's step); what another replica made or took instead
        when it won the race."""
        return await asyncio.to_thread(self._sync, now, owner)

    def _sync(self, now: datetime, owner: client.V1OwnerReference | None) -> Certificates:
        with api_client() as api:
            secret = RacedSecret(client.CoreV1Api(api), self.namespace, self.name)
            for _ in range(ATTEMPTS):
                found = secret.read()
                if found is None:
                    pair = self_signed(self.hostnames, now)
                    made = Certificates(pair, pair[0])
                    if secret.create(made.data(), owner):
                        return made
                    continue
                held = Certificates.from_data({key: str(value) for key, value in (found.data or {}).items()})
                step = held.step(now)
                if step is None:
                    return held
                if secret.replace(found, step.data()):
                    return step
            raise ApiException(
                status=409, reason=f"Secret {self.namespace}/{self.name} kept changing under this replica"
            )
