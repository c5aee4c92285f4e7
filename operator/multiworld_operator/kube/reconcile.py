"""One MultiWorld's reconcile step: observe, plan, execute, store the status.

Level-based and idempotent: every step lists the pods afresh and plans from the stored status,
so a step repeated, interrupted or run by a freshly restarted operator converges to the same
pods. Execution follows the planner's order, with the status standing for the world table:
deletes, then the status (every worker follows `status.table`), then creates, then Events.
Writing the status before the creates means a crash in between leaves the new epoch and pod
stamps stored, and the next step only creates what is still missing.

API writes for one world failure: that world's pods (deletes and creates), one status patch,
its Events; nothing scales with the number of other worlds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from kubernetes.client.rest import ApiException

from ..planner import MultiWorldStatus, Observation, Plan, plan
from ..spec import MultiWorld, SpecError, parse_manifest
from .api import KubeApi
from .bodies import declared_ports, network_policy_body, pod_body, rendezvous_host, selector, service_body
from .observe import ObjectMeta, ObservedPods, observe_pods
from .ports import world_ports
from .refusal import CREATE_REFUSED, INVALID_SPEC, RECONCILE_ERROR, error_patch, refusal_patch

log = logging.getLogger(__name__)

# Kubernetes caps an Event's message at 1 KiB.
EVENT_MESSAGE_MAX = 1024


class MultiWorldGone(Exception):
    """The MultiWorld was deleted while a step ran."""


class CreateRefused(Exception):
    """The API refused some creates (a pod, the Service), or their names are taken by objects
    that are not this MultiWorld's; the step is retried after a backoff."""


class Reconciler:
    """Reconciles one MultiWorld. `body` is its latest manifest as watched; the status this
    reconciler stored is remembered, since a watched body may lag behind our own writes."""

    def __init__(self, api: KubeApi, body: Mapping[str, Any]) -> None:
        self.api = api
        self.body: dict[str, Any] = dict(body)
        self.stored: dict[str, Any] | None = body.get("status")
        self.service_known = False
        # The error the last steps failed with, reported once (None once a step succeeds).
        self.failing_with: str | None = None
        # The spec generation whose NetworkPolicy was last made to match (None: not yet).
        self.policy_checked: int | None = None
        # Create failures already posted as Events, so a retried step does not repeat them.
        self._reported_errors: set[str] = set()

    @property
    def namespace(self) -> str:
        return str(self.body["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def uid(self) -> str:
        return str(self.body["metadata"]["uid"])

    def update(self, body: Mapping[str, Any]) -> bool:
        """Take a newer manifest; True when it asks for a step: a new spec (generation), the
        deletion starting, or a new uid (a new MultiWorld of the same name: start afresh).
        Our own status writes come back as such events too; they need no step."""
        old = self.body["metadata"]
        new = body["metadata"]
        renewed = new["uid"] != old["uid"]
        if renewed:
            self.stored, self.service_known, self.policy_checked = body.get("status"), False, None
            self._reported_errors.clear()
        self.body = dict(body)
        return renewed or new.get("generation") != old.get("generation") or self.deleting

    @property
    def deleting(self) -> bool:
        return self.body["metadata"].get("deletionTimestamp") is not None

    async def step(self) -> float | None:
        """Reconcile once; returns seconds until the planner wants another look, if it does."""
        if self.deleting:
            return None
        body = self.body
        try:
            multiworld = parse_manifest(body)
        except SpecError as error:
            await self._refuse(body, error.problems)
            return None
        items = await self.api.list_pods(self.namespace, selector(self.name))
        seen = observe_pods(items, self.uid)
        result = self._plan(multiworld, seen)
        await self._ensure_service(body)
        await self._ensure_network_policy(body, multiworld)
        for delete in result.deletes:
            uid = seen.present.get(delete.pod)
            if uid is not None and delete.pod not in seen.terminating:
                log.info("%s/%s: deleting pod %s (%s)", self.namespace, self.name, delete.pod, delete.reason)
                await self.api.delete_pod(self.namespace, delete.pod, uid)
        await self._store(result.status)
        failures = []
        for create in result.creates:
            if create.pod in seen.terminating:
                # Deleted with a grace period (`kubectl delete pod`): its worlds failed already
                # and its replacement needs the name, so the rest of that period is cut short.
                log.info("%s/%s: deleting pod %s at once (replaced)", self.namespace, self.name, create.pod)
                await self.api.delete_pod(self.namespace, create.pod, seen.present[create.pod])
            if create.pod in seen.present:
                continue  # created once the old instance (or an older MultiWorld's pod) is gone
            try:
                if not await self.api.create_pod(self.namespace, pod_body(create, body)):
                    taken = await self._taken("pod", create.pod, await self.api.read_pod(self.namespace, create.pod))
                    if taken:
                        failures.append(taken)
            except ApiException as error:
                if error.status is not None and error.status >= 500:
                    raise
                failures.append(f"pod {create.pod}: {api_message(error)}")
        for event in result.events:
            await self._event(event.type, event.reason, event.message)
        if failures:
            await self._report_create_failures(failures)
        return result.requeue_after

    def _plan(self, multiworld: MultiWorld, seen: ObservedPods) -> Plan:
        previous = MultiWorldStatus.from_dict(self.stored)
        ports = world_ports(multiworld, previous.table if previous else None)
        return plan(
            multiworld,
            previous,
            Observation(now=datetime.now(timezone.utc), pods=seen.pods, reports=seen.reports),
            endpoint=lambda world, rank0: (rendezvous_host(self.name, rank0), ports[world]),
        )

    async def _ensure_service(self, body: Mapping[str, Any]) -> None:
        if self.service_known:
            return
        if not await self.api.create_service(self.namespace, service_body(body)):
            taken = await self._taken("Service", self.name, await self.api.read_service(self.namespace, self.name))
            if taken:
                await self._report_create_failures([taken])
        self.service_known = True

    async def _ensure_network_policy(self, body: Mapping[str, Any], multiworld: MultiWorld) -> None:
        """The MultiWorld's NetworkPolicy exists while spec.networkPolicy is on, and ours is gone
        when it is off. Checked once per spec generation."""
        generation = body["metadata"].get("generation")
        if self.policy_checked == generation:
            return
        if multiworld.spec.network_policy:
            templates = [multiworld.template_of(m.name) for m in multiworld.spec.members]
            policy = network_policy_body(body, declared_ports(templates))
            if not await self.api.create_network_policy(self.namespace, policy):
                found = await self.api.read_network_policy(self.namespace, self.name)
                taken = await self._taken("NetworkPolicy", self.name, found)
                if taken:
                    await self._report_create_failures([taken])
                if found is not None and found["spec"] != policy["spec"]:  # the declared ports changed
                    await self.api.patch_network_policy(self.namespace, self.name, {"spec": policy["spec"]})
        else:
            found = await self.api.read_network_policy(self.namespace, self.name)
            if found is not None and not await self._taken("NetworkPolicy", self.name, found):
                await self.api.delete_network_policy(self.namespace, self.name, found["metadata"]["uid"])
        self.policy_checked = generation

    async def _taken(self, kind: str, name: str, found: Mapping[str, Any] | None) -> str | None:
        """Why `name` cannot be ours: an object of that name that this MultiWorld does not own
        (left alone, and named with its owner); None when it is ours, or gone meanwhile."""
        if found is None:
            return None
        meta = ObjectMeta.model_validate(found["metadata"])
        if meta.owned_by(self.uid):
            return None
        owner = meta.controller
        return (f"{kind} {name} already exists and is not this MultiWorld's "
                f"({f'owned by {owner.kind} {owner.name}' if owner else 'it has no owner'}); it is left alone")

    async def _store(self, status: MultiWorldStatus) -> None:
        desired = status.to_dict()
        if desired == self.stored:
            return
        await self._patch_status(status.merge_patch(self.stored), desired)

    async def _patch_status(self, patch: dict[str, Any], desired: dict[str, Any]) -> None:
        try:
            await self.api.patch_status(self.namespace, self.name, patch)
        except ApiException as error:
            if error.status == 404:
                raise MultiWorldGone(f"{self.namespace}/{self.name}") from error
            raise
        self.stored = desired

    async def _refuse(self, body: Mapping[str, Any], problems: list[str]) -> None:
        generation = body["metadata"].get("generation")
        patch = refusal_patch(self.stored, generation, problems, datetime.now(timezone.utc))
        if patch is None:
            return
        log.warning("%s/%s: %s", self.namespace, self.name, "; ".join(problems))
        await self._patch_status(patch, {**(self.stored or {}), **patch})
        await self._event("Warning", INVALID_SPEC, patch["conditions"][-1]["message"])

    async def report_error(self, error: Exception) -> None:
        """A failed step shows in the status (and, when unexpected, as an Event; refused creates
        have theirs already), once per distinct message, not only in the operator's log."""
        if isinstance(error, CreateRefused):
            reason, message = CREATE_REFUSED, str(error)
        else:
            reason, message = RECONCILE_ERROR, f"reconcile step failed: {type(error).__name__}: {error}"
        message = message[:EVENT_MESSAGE_MAX]
        patch = error_patch(self.stored, reason, message, datetime.now(timezone.utc))
        if patch is not None:  # a failed step may have stored the planner's status first
            await self._patch_status(patch, {**(self.stored or {}), **patch})
        if reason == RECONCILE_ERROR and message != self.failing_with:
            await self._event("Warning", RECONCILE_ERROR, message)
        self.failing_with = message

    async def _report_create_failures(self, failures: list[str]) -> None:
        """Creates the API refused (a template Kubernetes rejects, a quota, RBAC) or names taken
        by objects not ours: an Event once per distinct refusal, then the loop retries with a
        backoff."""
        new = [f for f in failures if f not in self._reported_errors]
        for failure in new:
            await self._event("Warning", CREATE_REFUSED, failure)
            self._reported_errors.add(failure)
        raise CreateRefused("; ".join(failures))

    async def _event(self, type_: str, reason: str, message: str) -> None:
        """Events are best effort: a lost one must not stop the reconcile."""
        try:
            await self.api.post_event(self.body, type_, reason, message)
        except ApiException as error:
            log.warning("%s/%s: event %s not posted: %s", self.namespace, self.name, reason, api_message(error))


def api_message(error: ApiException) -> str:
    """The API's own explanation (its Status message), else the HTTP reason."""
    try:
        message = json.loads(error.body)["message"]
    except (TypeError, ValueError, KeyError):
        message = error.reason
    return f"{error.status} {message}"
