"""Admission webhooks in the test cluster, which has no node: the API server runs on this host.

The chart's: the release's ValidatingWebhookConfiguration is pointed at the operator on this
host (`https://localhost:PORT/spec`, a name its certificate holds) instead of the Service the
chart names. Everything else (rules, failurePolicy, timeout, the operator's RBAC, the caBundle
the operator writes) is the chart's and the operator's own.

`RefusingWebhook`: one of the tests' own, refusing chosen writes (a real fault: the API
server's own answer to a write that a webhook refused)."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import tempfile
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubernetes import client

from multiworld_operator.kube.admission.certificate import self_signed
from multiworld_operator.kube.admission.webhook import HANDLER_ID
from tests.cluster import cluster as cluster_module

JSON_PATCH = "application/json-patch+json"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
CA_BUNDLE_TIMEOUT_S = 90.0


def serve_from_this_host(api: client.ApiClient, configuration: str, port: int, namespaces: list[str]) -> None:
    """Point the chart's webhook at the operator on this host. Before the operator starts: the
    new clientConfig has no caBundle until the operator writes it. The namespaces get the label
    Kubernetes sets itself from 1.21 on (the chart's namespaceSelector; this API server is 1.20)."""
    core = client.CoreV1Api(api)
    for namespace in namespaces:
        core.patch_namespace(namespace, {"metadata": {"labels": {NAMESPACE_NAME_LABEL: namespace}}})
    url = f"https://localhost:{port}/{HANDLER_ID}"
    client.AdmissionregistrationV1Api(api).patch_validating_webhook_configuration(
        configuration,
        [{"op": "replace", "path": "/webhooks/0/clientConfig", "value": {"url": url}}],
        _content_type=JSON_PATCH,
    )


def ca_bundle(api: client.ApiClient, configuration: str) -> str | None:
    read = client.AdmissionregistrationV1Api(api).read_validating_webhook_configuration(configuration)
    (webhook,) = api.sanitize_for_serialization(read)["webhooks"]
    bundle: str | None = webhook["clientConfig"].get("caBundle")
    return bundle


def wait_listening(port: int) -> None:
    """Until the operator's webhook takes connections on this host: it listens once the caBundle
    holds its certificate (the chart's readiness probe)."""

    def listening() -> bool:
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
        except OSError:
            return False
        return True

    cluster_module.wait_for(f"the webhook to listen on port {port}", listening, CA_BUNDLE_TIMEOUT_S)


def wait_ca_bundle(api: client.ApiClient, configuration: str) -> str:
    """Until the operator has written its CA into the configuration (it serves from then on)."""
    return cluster_module.wait_for(
        f"the operator to write the caBundle of {configuration}",
        lambda: ca_bundle(api, configuration),
        CA_BUNDLE_TIMEOUT_S,
    )


class RefusingWebhook:
    """A validating admission webhook of the test's own, served on this host over HTTPS: while
    `refusing`, it refuses `operation` of `resource` (core group) in `namespace` with `MESSAGE`;
    `refused` counts its refusals. A real one: the API server calls it as it would any webhook."""

    MESSAGE = "refused by the test's admission webhook"

    def __init__(self, api: client.ApiClient, namespace: str, operation: str, resource: str) -> None:
        self.api, self.namespace = api, namespace
        self.operation, self.resource = operation, resource
        self.name = f"refuse-{namespace}"
        self.refusing = True
        self.refused = 0
        certificate, key = self_signed(["localhost"], datetime.now(UTC))
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "tls.crt").write_bytes(certificate)
            (Path(folder) / "tls.key").write_bytes(key)
            self.context.load_cert_chain(Path(folder) / "tls.crt", Path(folder) / "tls.key")
        self.ca_bundle = base64.b64encode(certificate).decode()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.socket = self.context.wrap_socket(self.server.socket, server_side=True)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        webhook = self

        class Review(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                allowed = not webhook.refusing
                webhook.refused += not allowed
                answer = {"uid": review["request"]["uid"], "allowed": allowed}
                if not allowed:
                    answer["status"] = {"code": 403, "message": webhook.MESSAGE}
                body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": answer})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: object) -> None:  # one line per review is noise in a test's output
                pass

        return Review

    def __enter__(self) -> RefusingWebhook:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        client.CoreV1Api(self.api).patch_namespace(
            self.namespace, {"metadata": {"labels": {NAMESPACE_NAME_LABEL: self.namespace}}}
        )
        rule = {"operations": [self.operation], "apiGroups": [""], "apiVersions": ["v1"], "resources": [self.resource]}
        configuration: Any = {  # a body as JSON, which the client takes for its model
            "metadata": {"name": self.name},
            "webhooks": [{
                "name": "refuse.test.multiworld.io",
                "clientConfig": {"url": f"https://localhost:{self.server.server_address[1]}/",
                                 "caBundle": self.ca_bundle},
                "rules": [rule],
                "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: self.namespace}},
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "failurePolicy": "Fail",
                "timeoutSeconds": 5,
            }],
        }  # fmt: skip
        client.AdmissionregistrationV1Api(self.api).create_validating_webhook_configuration(configuration)
        return self

    def __exit__(self, *_: object) -> None:
        client.AdmissionregistrationV1Api(self.api).delete_validating_webhook_configuration(self.name)
        self.server.shutdown()
        self.server.server_close()
