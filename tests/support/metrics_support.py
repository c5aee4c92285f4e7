"""Reading the operator's metrics as Prometheus does (issue 32, finding 6): over HTTPS with a
bearer token, here from raw sockets (any source address of 127/8), the answer's status and body;
and the token of a ServiceAccount bound to a ClusterRole (the chart's metrics-reader) or to none."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

TOKEN_LIFETIME_S = 3600


@dataclass(frozen=True)
class Answer:
    status: int
    body: str


def get_metrics(
    port: int,
    token: str | None = None,
    *,
    ca: str | None = None,
    server_name: str = "localhost",
    source: str = "127.0.0.1",
    timeout: float = 10.0,
) -> Answer:
    """GET /metrics over TLS (verified against `ca` for `server_name`; unverified without `ca`),
    bearing `token` if any."""
    context = ssl.create_default_context(cadata=ca) if ca is not None else ssl._create_unverified_context()
    authorization = "" if token is None else f"Authorization: Bearer {token}\r\n"
    request = f"GET /metrics HTTP/1.1\r\nHost: {server_name}\r\n{authorization}Connection: close\r\n\r\n"
    raw = socket.create_connection(("127.0.0.1", port), timeout, source_address=(source, 0))
    with context.wrap_socket(raw, server_hostname=server_name) as tls:
        tls.sendall(request.encode())
        chunks = []
        try:
            while chunk := tls.recv(1 << 16):
                chunks.append(chunk)
        except ssl.SSLEOFError:
            pass  # closed without TLS's goodbye: what came is all there is
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    if not head:
        raise ConnectionResetError("closed without an answer")
    return Answer(int(head.split()[1]), body.decode())


@contextmanager
def service_account_token(api: client.ApiClient, namespace: str, name: str, cluster_role: str | None) -> Iterator[str]:
    """A token (for the API server's own audiences, as the kubelet mounts one) of a new
    ServiceAccount `name`, bound to `cluster_role` while in use (None: to nothing)."""
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name)))
    binding = f"{namespace}-{name}"
    if cluster_role is not None:
        rbac.create_cluster_role_binding(
            client.V1ClusterRoleBinding(
                metadata=client.V1ObjectMeta(name=binding),
                role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=cluster_role),
                subjects=[client.RbacV1Subject(kind="ServiceAccount", name=name, namespace=namespace)],
            )
        )
    try:
        request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=TOKEN_LIFETIME_S))  # fmt: skip
        issued: Any = core.create_namespaced_service_account_token(name, namespace, request)
        yield str(issued.status.token)
    finally:
        if cluster_role is not None:
            try:
                rbac.delete_cluster_role_binding(binding)
            except ApiException as error:
                if error.status != 404:
                    raise
