"""One MultiWorld's reconcile step: observe, plan, execute, store.

Level-based and idempotent: every step plans from the pods as they are (a cache kept current by
the pod watch, listed afresh now and then: pod_cache.py) and from the planner's memory, so a
step repeated, interrupted or run by a freshly restarted operator converges to the same pods.
Execution follows the planner's order: deletes (pods go at once, so a plan that deleted is
followed by a plan from its status that replaces them, in the same step); the memory (the
ConfigMap named like the MultiWorld: memory.py); the live table (one ConfigMap per world that
changed: world_tables.py); creates; the labels of warm spares given a member pod to play (their
workers learn it from the table); the CR's status (the view kubectl shows, written after the
creates: on a MultiWorld of thousands of worlds the API server takes a moment over it); Events.
The memory goes before the table and the creates, so a crash in between leaves the new epoch
and pod stamps stored, and the next step only publishes and creates what is still missing.

API writes for one world failure: that world's pods (deletes and creates), its ConfigMap, the
memory, one status patch and its Events; nothing scales with the number of other worlds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.rest import ApiException

from multiworld.contract import WORLD_LABEL, WorldEntry, WorldTable, world_table_name
from multiworld.kube_api import EVENT_MESSAGE_MAX, api_message

from ..planner import CreatePod, MultiWorldStatus, Observation, Plan, merge_patch, plan
from ..spec import MultiWorld, SpecError, parse_manifest
from .api import KubeApi, each
from .bodies import (
    declared_ports,
    network_policy_body,
    plays_labels,
    pod_body,
    rendezvous_host,
    selector,
    service_body,
)
from .memory import memory_body, read_memory
from .observe import ObjectMeta, ObservedPods, observe_pods
from .pod_cache import PodCache
from .ports import world_ports
from .refusal import CREATE_REFUSED, INVALID_SPEC, RECONCILE_ERROR, error_patch, refusal_patch
from .world_tables import published_entry, table_writes, world_table_body

log = logging.getLogger(__name__)

# Plans per step: a plan that deleted pods is followed by one that replaces them.
REPLANS = 3


class MultiWorldGone(Exception):
    """The MultiWorld was deleted while a step ran."""


class CreateRefused(Exception):
    """The API refused some creates (a pod, the Service), or their names are taken by objects
    that are not this MultiWorld's; the step is retried after a backoff."""


class Reconciler:
    """Reconciles one MultiWorld. `body` is its latest manifest as watched. What this reconciler
    wrote (the memory, the status view, the table's entries) is remembered, since a watched
    body may lag behind our own writes."""

    def __init__(self, api: KubeApi, body: Mapping[str, Any]) -> None:
        self.api = api
        self.body: dict[str, Any] = dict(body)
        self.pods = PodCache(self.uid)
        self._start_afresh()
        # The error the last steps failed with, reported once (None once a step succeeds).
        self.failing_with: str | None = None

    def _start_afresh(self) -> None:
        """Forget what was known of an earlier MultiWorld of this name."""
        # The planner's memory as stored, and as the planner reads it (None: not read yet, or
        # there is none: see _load).
        self.memory: dict[str, Any] | None = None
        self.remembered: MultiWorldStatus | None = None
        self.loaded = False
        # The CR's status as last written or watched.
        self.view: dict[str, Any] | None = self.body.get("status")
        # World -> the entry its ConfigMap holds now (None: there, but unreadable).
        self.published: dict[str, WorldEntry | None] = {}
        # ConfigMap name -> the resourceVersion this reconciler last wrote or read.
        self.versions: dict[str, str] = {}
        self.service_known = False
        # The spec generation whose NetworkPolicy was last made to match (None: not yet).
        self.policy_checked: int | None = None
        self._parsed: tuple[tuple[str, int | None], MultiWorld] | None = None
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
        self.body = dict(body)
        if renewed:
            self.pods = PodCache(self.uid)
            self._start_afresh()
        return renewed or new.get("generation") != old.get("generation") or self.deleting

    def pod_changed(self, deleted: bool, pod: Mapping[str, Any]) -> bool:
        """A pod of this MultiWorld as the watch reported it; True when it is news."""
        return self.pods.changed(deleted, pod)

    @property
    def deleting(self) -> bool:
        return self.body["metadata"].get("deletionTimestamp") is not None

    def _multiworld(self, body: Mapping[str, Any]) -> MultiWorld:
        """The parsed manifest, parsed once per spec generation."""
        key = (self.uid, body["metadata"].get("generation"))
        if self._parsed is None or self._parsed[0] != key:
            self._parsed = (key, parse_manifest(body))
        return self._parsed[1]

    async def step(self) -> float | None:
        """Reconcile once; returns seconds until the planner wants another look, if it does."""
        if self.deleting:
            return None
        body = self.body
        try:
            multiworld = self._multiworld(body)
        except SpecError as error:
            await self._refuse(body, error.problems)
            return None
        await self._load()
        if self.pods.stale():
            self.pods.listed(*await self.api.list_pods(self.namespace, selector(self.name)))
        await self._ensure_service(body)
        await self._ensure_network_policy(body, multiworld)
        previous, events = self.remembered, []
        for _ in range(REPLANS):
            seen = observe_pods(self.pods.pods())
            result = self._plan(multiworld, previous, seen)
            events += result.events
            if not await self._delete_pods(result, seen):
                break
            # Pods are deleted at once: plan again from that plan's status, so that their
            # replacements are created in this step rather than on the next watch event.
            previous = result.status
        refused = await self._remember(body, result.status)
        if refused:
            await self._report_create_failures([refused])  # nothing goes out before the memory
        failures = await self._publish(body, result.table)
        failures += [f for f in await each(self._create(body, c, seen) for c in result.creates) if f]
        await self._label_spares(multiworld, result.status)
        await self._show(result.status)
        await each(self._event(e.type, e.reason, e.message) for e in events)
        if failures:
            await self._report_create_failures(failures)
        return result.requeue_after

    async def _load(self) -> None:
        """Once: the memory (its ConfigMap; else a status an operator before it wrote whole,
        with the table; else none: a new MultiWorld) and the table's entries as published."""
        if self.loaded:
            return
        found = await self.api.read_configmap(self.namespace, self.name)
        if found is not None and ObjectMeta.model_validate(found["metadata"]).owned_by(self.uid):
            self.memory = read_memory(found)
            self.versions[self.name] = str(found["metadata"]["resourceVersion"])
        elif self.view is not None and "table" in self.view:
            self.memory = dict(self.view)
        elif self.view is not None and self.view.get("worlds"):
            log.warning(
                "%s/%s: the operator's memory (ConfigMap %s) is gone: every world starts afresh",
                self.namespace,
                self.name,
                self.name,
            )
        self.remembered = MultiWorldStatus.from_dict(self.memory)
        for item in await self.api.list_configmaps(self.namespace, f"{selector(self.name)},{WORLD_LABEL}"):
            meta = ObjectMeta.model_validate(item["metadata"])
            if meta.owned_by(self.uid) and WORLD_LABEL in meta.labels:
                self.published[meta.labels[WORLD_LABEL]] = published_entry(item)
                self.versions[meta.name] = meta.resource_version
        self.loaded = True

    def _plan(self, multiworld: MultiWorld, previous: MultiWorldStatus | None, seen: ObservedPods) -> Plan:
        ports = world_ports(multiworld, previous.table if previous else None)
        return plan(
            multiworld,
            previous,
            Observation(now=datetime.now(UTC), pods=seen.pods, reports=seen.reports),
            endpoint=lambda world, rank0: (rendezvous_host(self.name, rank0), ports[world]),
        )

    async def _delete_pods(self, result: Plan, seen: ObservedPods) -> bool:
        """The plan's deletes; whether any pod was deleted."""
        deleted = False
        for delete in result.deletes:
            uid = seen.present.get(delete.pod)
            if uid is not None and delete.pod not in seen.terminating:
                log.info("%s/%s: deleting pod %s (%s)", self.namespace, self.name, delete.pod, delete.reason)
                deleted = await self._delete_pod(delete.pod, uid) or deleted
        return deleted

    async def _delete_pod(self, pod: str, uid: str) -> bool:
        """Delete that instance; whether it was there to delete (its replacement may follow)."""
        deleted = await self.api.delete_pod(self.namespace, pod, uid)
        if deleted is None:
            return False
        self.pods.changed(True, deleted)
        return True

    async def _create(self, body: Mapping[str, Any], create: CreatePod, seen: ObservedPods) -> str | None:
        """Create one pod; why it could not be, if it could not."""
        if create.pod in seen.terminating:
            # Deleted with a grace period (`kubectl delete pod`): its worlds failed already
            # and its replacement needs the name, so the rest of that period is cut short.
            log.info("%s/%s: deleting pod %s at once (replaced)", self.namespace, self.name, create.pod)
            await self._delete_pod(create.pod, seen.present[create.pod])
        if create.pod in seen.present:
            return None  # created once the old instance (or an older MultiWorld's pod) is gone
        try:
            created = await self.api.create_pod(self.namespace, pod_body(create, body))
        except ApiException as error:
            if error.status is not None and error.status >= 500:
                raise
            return f"pod {create.pod}: {api_message(error)}"
        if created is not None:
            self.pods.changed(False, created)
            return None
        return await self._taken("pod", create.pod, await self.api.read_pod(self.namespace, create.pod))

    async def _label_spares(self, multiworld: MultiWorld, status: MultiWorldStatus) -> None:
        """A warm spare that plays a member pod says which in its labels, for people (its
        worker learns it from the table, written before)."""
        if not status.played_by:
            return
        plays = {pod.name: pod.plays for pod in self.pods.pods()}

        async def label(pod: str, spare: str) -> None:
            _, ordinal = multiworld.member_of_pod(pod)
            patched = await self.api.label_pod(self.namespace, spare, plays_labels(pod, ordinal))
            if patched is not None:
                self.pods.changed(False, patched)

        await each(label(pod, spare) for pod, spare in status.played_by.items() if plays.get(spare, pod) != pod)

    async def _remember(self, body: Mapping[str, Any], status: MultiWorldStatus) -> str | None:
        """Store the planner's memory; why it could not be, if it could not."""
        memory = status.to_dict()  # compared as dicts: far cheaper than comparing the models
        if memory != self.memory and not await self._write_configmap(memory_body(body, memory)):
            return (
                f"ConfigMap {self.name} (the operator's memory of this MultiWorld) already exists and is "
                "not this MultiWorld's; it is left alone"
            )
        self.memory, self.remembered = memory, status
        return None

    async def _publish(self, body: Mapping[str, Any], table: WorldTable) -> list[str]:
        """Make the world ConfigMaps hold the table's entries."""
        writes = table_writes(self.published, table)

        async def write(entry: WorldEntry) -> str | None:
            if not await self._write_configmap(world_table_body(body, entry)):
                return (
                    f"ConfigMap {world_table_name(self.name, entry.name)} (world {entry.name}'s table entry) "
                    "already exists and is not this MultiWorld's; it is left alone"
                )
            self.published[entry.name] = entry
            return None

        async def remove(world: str) -> None:
            await self.api.delete_configmap(self.namespace, world_table_name(self.name, world))
            self.versions.pop(world_table_name(self.name, world), None)
            del self.published[world]

        failures = await each(write(entry) for entry in writes.write)
        await each(remove(world) for world in writes.remove)
        return [f for f in failures if f]

    async def _write_configmap(self, body: dict[str, Any]) -> bool:
        name = body["metadata"]["name"]
        version = await self.api.write_configmap(self.namespace, body, self.versions.get(name))
        if version is None:
            return False
        self.versions[name] = version
        return True

    async def _show(self, status: MultiWorldStatus) -> None:
        view = status.view()
        if view != self.view:
            await self._patch_status(merge_patch(self.view, view), view)

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
        return (
            f"{kind} {name} already exists and is not this MultiWorld's "
            f"({f'owned by {owner.kind} {owner.name}' if owner else 'it has no owner'}); it is left alone"
        )

    async def _patch_status(self, patch: dict[str, Any], desired: dict[str, Any]) -> None:
        try:
            await self.api.patch_status(self.namespace, self.name, patch)
        except ApiException as error:
            if error.status == 404:
                raise MultiWorldGone(f"{self.namespace}/{self.name}") from error
            raise
        self.view = desired

    async def _refuse(self, body: Mapping[str, Any], problems: list[str]) -> None:
        generation = body["metadata"].get("generation")
        patch = refusal_patch(self.view, generation, problems, datetime.now(UTC))
        if patch is None:
            return
        log.warning("%s/%s: %s", self.namespace, self.name, "; ".join(problems))
        await self._patch_status(patch, {**(self.view or {}), **patch})
        await self._event("Warning", INVALID_SPEC, patch["conditions"][-1]["message"])

    async def report_error(self, error: Exception) -> None:
        """A failed step shows in the status (and, when unexpected, as an Event; refused creates
        have theirs already), once per distinct message, not only in the operator's log."""
        if isinstance(error, CreateRefused):
            reason, message = CREATE_REFUSED, str(error)
        else:
            reason, message = RECONCILE_ERROR, f"reconcile step failed: {type(error).__name__}: {error}"
        message = message[:EVENT_MESSAGE_MAX]
        patch = error_patch(self.view, reason, message, datetime.now(UTC))
        if patch is not None:  # a failed step may have stored the planner's status first
            await self._patch_status(patch, {**(self.view or {}), **patch})
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
