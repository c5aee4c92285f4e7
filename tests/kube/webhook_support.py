"""The chart's admission webhook in the test cluster, which has no node: the API server runs on
this host, so the release's ValidatingWebhookConfiguration is pointed at the operator on this
host (`https://localhost:PORT/spec`, a name its certificate holds) instead of the Service the
chart names. Everything else (rules, failurePolicy, timeout, the operator's RBAC, the caBundle
the operator writes) is the chart's and the operator's own."""

from __future__ import annotations

import multiworld_test_cluster as cluster_module  # registered by conftest.py
from kubernetes import client

from multiworld_operator.kube.admission import HANDLER_ID

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


def wait_ca_bundle(api: client.ApiClient, configuration: str) -> str:
    """Until the operator has written its CA into the configuration (it serves from then on)."""
    return cluster_module.wait_for(
        f"the operator to write the caBundle of {configuration}",
        lambda: ca_bundle(api, configuration),
        CA_BUNDLE_TIMEOUT_S,
    )
