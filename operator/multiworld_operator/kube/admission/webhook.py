"""The validating admission webhook: a MultiWorld whose spec is invalid is refused at `kubectl
apply` with every problem named by its field path. It asks spec.parse_manifest, the one
validation `multiworld run` and the condition SpecValid use, and answers in SpecValid's words
(refusal.refusal_message). An object admitted while the webhook was off or unreachable still
gets SpecValid=False from its reconcile loop.

Registered only when the operator serves a webhook port (`enable`): kopf refuses to start with
an admission handler and no server. The certificate and the caBundle: tls and
certificate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kopf

from multiworld_operator.kube.admission.certificate import CertificateSecret, secret_name, secret_namespace
from multiworld_operator.kube.admission.tls import AdmissionServer, CaBundle, ServedCertificate
from multiworld_operator.kube.reporting.refusal import refusal_message
from multiworld_operator.spec import SpecError, parse_manifest
from multiworld_operator.spec.resource import API_GROUP, API_VERSION, PLURAL

# The handler's id is the path kopf's server routes to it: the webhook configuration calls
# https://HOST:PORT/spec (a request to any other path is answered by no handler: allowed).
HANDLER_ID = "spec"


@dataclass(frozen=True)
class Webhook:
    """Where the webhook listens, the name the API server calls it by (its certificate's), and
    the ValidatingWebhookConfiguration whose caBundle the operator keeps."""

    port: int
    host: str
    configuration: str


def validate(*, body: kopf.Body, old: kopf.Body | None = None, operation: str | None = None, **_: Any) -> None:
    # An update that leaves the spec as it was (labels, annotations) is no new spec to judge:
    # an object admitted while the webhook was off stays editable; its SpecValid says what is wrong.
    if operation == "UPDATE" and old is not None and old.get("spec") == body.get("spec"):
        return
    try:
        parse_manifest(dict(body))
    except SpecError as error:
        raise kopf.AdmissionError(refusal_message(error.problems), code=422) from None


def enable(webhook: Webhook, settings: kopf.OperatorSettings, registry: kopf.OperatorRegistry) -> ServedCertificate:
    """Serve the webhook with this operator: kopf's server (tls) and the handler; the
    certificate it serves, for the metrics to show too."""
    hostnames = [webhook.host, "localhost"]
    secret = CertificateSecret(secret_namespace(webhook.host), secret_name(webhook.configuration), hostnames)
    served = ServedCertificate()
    settings.admission.server = AdmissionServer(webhook.port, CaBundle(webhook.configuration), secret, served)
    kopf.on.validate(API_GROUP, API_VERSION, PLURAL, id=HANDLER_ID, operations=["CREATE", "UPDATE"], registry=registry)(
        validate
    )
    return served
