"""One Secret that the operator's replicas race to make and to change (the webhook's
certificate: admission/certificate.py; the key of the worlds' secrets: workers/world_key.py). Blocking calls,
in which a lost race is an answer rather than an error: a read finds nothing (404), a create
finds the Secret made (409), a replace at the resourceVersion read finds it changed (409)."""

from __future__ import annotations

from collections.abc import Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

from multiworld_operator.kube.client.api_basics import REQUEST_TIMEOUT_S


class RacedSecret:
    """The Secret `name` in `namespace`, through `core`."""

    def __init__(self, core: client.CoreV1Api, namespace: str, name: str) -> None:
        self.core, self.namespace, self.name = core, namespace, name

    def read(self) -> client.V1Secret | None:
        """The Secret; None when there is none."""
        try:
            return self.core.read_namespaced_secret(self.name, self.namespace, _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def create(self, data: dict[str, str], owner: client.V1OwnerReference | None = None) -> bool:
        """Whether this replica made it, holding `data` (False: another one did first)."""
        metadata = client.V1ObjectMeta(name=self.name, owner_references=None if owner is None else [owner])
        body = client.V1Secret(metadata=metadata, type="Opaque", data=data)
        return _won(
            lambda: self.core.create_namespaced_secret(self.namespace, body, _request_timeout=REQUEST_TIMEOUT_S)
        )

    def replace(self, found: client.V1Secret, data: dict[str, str]) -> bool:
        """Whether `data` was written over `found`, at its resourceVersion (False: another
        replica wrote first)."""
        body = client.V1Secret(metadata=found.metadata, type=found.type or "Opaque", data=data)
        return _won(
            lambda: self.core.replace_namespaced_secret(
                self.name, self.namespace, body, _request_timeout=REQUEST_TIMEOUT_S
            )
        )


def _won(write: Callable[[], object]) -> bool:
    try:
        write()
    except ApiException as error:
        if error.status == 409:
            return False
        raise
    return True
