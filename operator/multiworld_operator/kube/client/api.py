"""The operator's API calls, async (the blocking client runs in worker threads), each with a
timeout, bodies as plain dicts. Idempotent where the reconcile loop needs it: creating what
exists and deleting what is gone are not errors."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping
from concurrent.futures import Executor
from contextvars import copy_context
from typing import Any, TypeVar, cast

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.config.config_exception import ConfigException

from multiworld_operator.kube.client.api_basics import MERGE_PATCH, REQUEST_TIMEOUT_S, event_body
from multiworld_operator.kube.objects.bodies import COMPONENT
from multiworld_operator.kube.objects.observe import ObjectMeta
from multiworld_operator.spec.resource import API_GROUP, API_VERSION, GROUP_VERSION, KIND, PLURAL

log = logging.getLogger(__name__)
T = TypeVar("T")

# Requests one reconcile step has in flight at once (creating a thousand pods one at a time
# would take most of a minute).
CONCURRENCY = 8


def api_client() -> client.ApiClient:
    """In-cluster credentials (the operator's ServiceAccount), else $KUBECONFIG or ~/.kube/config."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except ConfigException:
        return config.new_client_from_config()
    return client.ApiClient(configuration)


class _NotStarted(Exception):
    """A call of a batch left unstarted because another call of the batch failed."""


async def gather_bounded(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Await `calls`, at most CONCURRENCY at a time; their results in order. When one fails, no
    further call starts and the ones in flight are awaited before its error is raised, so no
    request of a failed step lands during the next one."""
    gate = asyncio.Semaphore(CONCURRENCY)
    failed = False

    async def gated(call: Coroutine[Any, Any, T]) -> T:
        nonlocal failed
        async with gate:
            if failed:
                call.close()
                raise _NotStarted
            try:
                return await call
            except Exception:
                failed = True
                raise

    results = await asyncio.gather(*(gated(c) for c in calls), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, _NotStarted):
            raise result
    return cast("list[T]", results)


# Told of each failed call: the client method's name, and the HTTP status ("transport": no answer).
ErrorCounter = Callable[[str, str], None]


def _uncounted(method_name: str, code: str) -> None:
    pass


class KubeApi:
    """The calls, each with `timeout`, in `executor`'s threads (None: the event loop's default);
    each failed call is told to `on_error`."""

    def __init__(
        self,
        api: client.ApiClient,
        timeout: float = REQUEST_TIMEOUT_S,
        executor: Executor | None = None,
        on_error: ErrorCounter = _uncounted,
    ) -> None:
        api.user_agent = COMPONENT  # names the operator in managedFields and audit logs
        self.core = client.CoreV1Api(api)
        self.networking = client.NetworkingV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.authentication = client.AuthenticationV1Api(api)
        self.authorization = client.AuthorizationV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.timeout = timeout
        self.executor = executor
        self.on_error = on_error

    async def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(method, *args, _preload_content=False, _request_timeout=self.timeout, **kwargs)
        try:
            # In this context (the MultiWorld a loop is bound to), as asyncio.to_thread would.
            response = await asyncio.get_running_loop().run_in_executor(self.executor, copy_context().run, call)
        except ApiException as error:
            self.on_error(method.__name__, str(error.status))
            raise
        except (urllib3.exceptions.HTTPError, OSError):
            self.on_error(method.__name__, "transport")
            raise
        return json.loads(response.data) if response.data else None

    async def review_token(self, token: str, audience: str | None) -> dict[str, Any]:
        """A TokenReview's status: whether the API server accepts `token` for `audience` (None:
        for the API server's own audiences), and whose it is (user.username, uid, groups, extra)."""
        spec: dict[str, Any] = {"token": token} if audience is None else {"token": token, "audiences": [audience]}
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}
        review = await self._call(self.authentication.create_token_review, body)
        return dict(review.get("status") or {})

    async def review_access(self, user: Mapping[str, Any], verb: str, path: str) -> dict[str, Any]:
        """A SubjectAccessReview's status: whether `user` (a TokenReview's) may `verb` the
        non-resource URL `path` (allowed, reason)."""
        spec = {key: user[key] for key in ("uid", "groups", "extra") if user.get(key)}
        spec.update(user=str(user.get("username", "")), nonResourceAttributes={"path": path, "verb": verb})
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
        review = await self._call(self.authorization.create_subject_access_review, body)
        return dict(review.get("status") or {})

    async def list_pods(self, namespace: str, label_selector: str) -> tuple[list[dict[str, Any]], str]:
        """The pods, and the resourceVersion the listing is from."""
        listing = await self._call(self.core.list_namespaced_pod, namespace, label_selector=label_selector)
        return list(listing.get("items") or []), str(listing["metadata"].get("resourceVersion", ""))

    async def read_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._read(self.core.read_namespaced_config_map, namespace, name)

    async def write_configmap(self, namespace: str, body: dict[str, Any], version: str | None) -> str | None:
        """Replace the ConfigMap at resourceVersion `version` (the one the caller last wrote or
        read), or create it (`version` None, or it was deleted meanwhile). Returns its new
        resourceVersion; None when the name is taken by a ConfigMap the body's owner does not
        control (left alone). Never overwrites what it has not seen: a ConfigMap written (or
        created) meanwhile by someone else is a 409, raised for the caller to read it again."""
        name = body["metadata"]["name"]
        if version is not None:
            replaced = {**body, "metadata": {**body["metadata"], "resourceVersion": version}}
            try:
                written = await self._call(self.core.replace_namespaced_config_map, name, namespace, replaced)
                return str(written["metadata"]["resourceVersion"])
            except ApiException as error:
                if error.status != 404:
                    raise
        try:
            created = await self._call(self.core.create_namespaced_config_map, namespace, body)
        except ApiException as error:
            if error.status != 409:
                raise
            found = await self._read(self.core.read_namespaced_config_map, namespace, name)
            if found is not None and not ObjectMeta.model_validate(found["metadata"]).owned_by(
                body["metadata"]["ownerReferences"][0]["uid"]
            ):
                return None
            raise
        return str(created["metadata"]["resourceVersion"])

    async def create_pod(self, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The pod created; None when a pod of that name already exists."""
        return await self._create(self.core.create_namespaced_pod, namespace, body)

    async def create_service(self, namespace: str, body: dict[str, Any]) -> bool:
        return await self._create(self.core.create_namespaced_service, namespace, body) is not None

    async def create_network_policy(self, namespace: str, body: dict[str, Any]) -> bool:
        return await self._create(self.networking.create_namespaced_network_policy, namespace, body) is not None

    async def read_network_policy(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._read(self.networking.read_namespaced_network_policy, namespace, name)

    async def patch_network_policy(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self._call(
            self.networking.patch_namespaced_network_policy, name, namespace, patch, _content_type=MERGE_PATCH
        )

    async def delete_network_policy(self, namespace: str, name: str, uid: str) -> None:
        try:
            await self._call(
                self.networking.delete_namespaced_network_policy, name, namespace, body={"preconditions": {"uid": uid}}
            )
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    async def label_pod(self, namespace: str, name: str, labels: Mapping[str, str | None]) -> dict[str, Any] | None:
        """Set these labels on the pod (None removes one); the pod as patched, None when it is gone."""
        try:
            patched: dict[str, Any] = await self._call(
                self.core.patch_namespaced_pod,
                name,
                namespace,
                {"metadata": {"labels": dict(labels)}},
                _content_type=MERGE_PATCH,
            )
        except ApiException as error:
            if error.status != 404:
                raise
            return None
        return patched

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

    async def _create(self, method: Callable[..., Any], namespace: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The object created; None when one of that name exists."""
        try:
            created: dict[str, Any] = await self._call(method, namespace, body)
        except ApiException as error:
            if error.status == 409:
                return None
            raise
        return created

    async def delete_pod(self, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
        """Delete that instance only (a newer pod of the same name is left alone), at once: it
        leaves its worlds for good, and a frozen process could not run its own shutdown, so a
        grace period would only hold the name its replacement needs. Returns the pod as it was
        deleted; None when it was gone already."""
        try:
            deleted: dict[str, Any] = await self._call(
                self.core.delete_namespaced_pod,
                name,
                namespace,
                body={"preconditions": {"uid": uid}, "gracePeriodSeconds": 0},
            )
        except ApiException as error:
            if error.status not in (404, 409):
                raise
            return None
        return deleted

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self._call(
            self.custom.patch_namespaced_custom_object_status,
            API_GROUP,
            API_VERSION,
            namespace,
            PLURAL,
            name,
            {"status": patch},
            _content_type=MERGE_PATCH,
        )

    async def post_event(self, multiworld: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = multiworld["metadata"]
        involved = {
            "apiVersion": GROUP_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        }
        body = event_body(involved, type_, reason, message, COMPONENT)
        await self._call(self.core.create_namespaced_event, meta["namespace"], body)

    async def read_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._read(self.coordination.read_namespaced_lease, namespace, name)

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The Lease created; None when one of that name exists (someone else created it first)."""
        return await self._create(self.coordination.create_namespaced_lease, namespace, body)

    async def replace_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """Replace the Lease at the resourceVersion in `body`; None when it was written (or
        deleted) meanwhile: someone else won."""
        try:
            replaced: dict[str, Any] = await self._call(
                self.coordination.replace_namespaced_lease, body["metadata"]["name"], namespace, body
            )
        except ApiException as error:
            if error.status in (404, 409):
                return None
            raise
        return replaced
