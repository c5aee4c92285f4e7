"""The operator's API calls, async (the blocking client runs in worker threads), each with a
timeout, bodies as plain dicts. Idempotent where the reconcile loop needs it: creating what
exists and deleting what is gone are not errors."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from ..spec import API_GROUP, API_VERSION, GROUP_VERSION, KIND, PLURAL
from .bodies import COMPONENT

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0
MERGE_PATCH = "application/merge-patch+json"
# Kubernetes caps an Event's message at 1 KiB.
EVENT_MESSAGE_MAX = 1024


class KubeApi:
    def __init__(self, api: client.ApiClient, timeout: float = REQUEST_TIMEOUT_S) -> None:
        api.user_agent = COMPONENT  # names the operator in managedFields and audit logs
        self.core = client.CoreV1Api(api)
        self.networking = client.NetworkingV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.timeout = timeout

    async def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        response = await asyncio.to_thread(
            method, *args, _preload_content=False, _request_timeout=self.timeout, **kwargs
        )
        return json.loads(response.data) if response.data else None

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        listing = await self._call(self.core.list_namespaced_pod, namespace, label_selector=label_selector)
        return list(listing.get("items") or [])

    async def create_pod(self, namespace: str, body: dict[str, Any]) -> bool:
        """False when a pod of that name already exists."""
        return await self._create(self.core.create_namespaced_pod, namespace, body)

    async def create_service(self, namespace: str, body: dict[str, Any]) -> bool:
        return await self._create(self.core.create_namespaced_service, namespace, body)

    async def create_network_policy(self, namespace: str, body: dict[str, Any]) -> bool:
        return await self._create(self.networking.create_namespaced_network_policy, namespace, body)

    async def read_network_policy(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._read(self.networking.read_namespaced_network_policy, namespace, name)

    async def patch_network_policy(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self._call(self.networking.patch_namespaced_network_policy, name, namespace, patch,
                         _content_type=MERGE_PATCH)

    async def delete_network_policy(self, namespace: str, name: str, uid: str) -> None:
        try:
            await self._call(self.networking.delete_namespaced_network_policy, name, namespace,
                             body={"preconditions": {"uid": uid}})
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    async def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._read(self.core.read_namespaced_pod, namespace, name)

    async def read_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._read(self.core.read_namespaced_service, namespace, name)

    async def _read(self, method: Callable[..., Any], namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when there is none."""
        try:
            found: dict[str, Any] = await self._call(method, name, namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return found

    async def _create(self, method: Callable[..., Any], namespace: str, body: dict[str, Any]) -> bool:
        try:
            await self._call(method, namespace, body)
        except ApiException as error:
            if error.status == 409:
                return False
            raise
        return True

    async def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """Delete that instance only (a newer pod of the same name is left alone), at once: it
        leaves its worlds for good, and a frozen process could not run its own shutdown, so a
        grace period would only hold the name its replacement needs."""
        try:
            await self._call(self.core.delete_namespaced_pod, name, namespace,
                             body={"preconditions": {"uid": uid}, "gracePeriodSeconds": 0})
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self._call(self.custom.patch_namespaced_custom_object_status, API_GROUP, API_VERSION, namespace,
                         PLURAL, name, {"status": patch}, _content_type=MERGE_PATCH)

    async def post_event(self, multiworld: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = multiworld["metadata"]
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": GROUP_VERSION, "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "type": type_,
            "reason": reason,
            "message": message[:EVENT_MESSAGE_MAX],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self._call(self.core.create_namespaced_event, meta["namespace"], body)
