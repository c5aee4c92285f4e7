"""One MultiWorld's reconcile step: observe, plan, execute, store.

Level-based and idempotent: every step plans from the pods as they are (a cache kept current by
the pod watch, listed afresh now and then: pod_cache.py) and from the planner's memory, so a
step repeated, interrupted or run by a freshly restarted operator converges to the same pods.
The planner runs in a worker thread (one MultiWorld's plan never holds up another's loop). A
plan that deletes pods is followed by a plan from its status that sees them gone (they are
deleted at once), so their replacements go out in the same step. Execution then follows the
planner's order, with the memory first: the memory (the ConfigMap named like the MultiWorld:
memory_store.py), which accounts for every delete and create below; deletes; the live table (to
the workers' channel: each connected pod gets its own worlds' entries where they changed);
creates (the table's entries and the pods' start-up worlds carry each world's secret at its
epoch: ../world_secrets.py, under the operator's key, world_key.py; the memory holds none); the
labels of warm spares given a member pod to play (their workers learn it from the table); the
CR's status (the view kubectl shows, written after the creates: on a MultiWorld of
thousands of worlds the API server takes a moment over it: status_writer.py); Events (events.py).
The Service and the NetworkPolicy (networking.py) are made to exist before any of it.
A crash (or a refused write) anywhere leaves the memory stored before what it speaks of: nothing
is deleted that it does not account for, and the next step only deletes, publishes and creates
what is still missing. A failed API call ends the step with a StepFailed that says what failed
(errors.py), which the loop shows and retries (controller.py); a 409 (someone else wrote the
memory's ConfigMap) makes the next step read the memory again.

What workers say (their status, their reports) comes over the worker channel, from the pod that
says it (worker_identity.py), and is checked against the published table (worker_inbox.py).

API writes for one world failure: that world's pods (deletes and creates), the memory, one status
patch and its Events; nothing scales with the number of other worlds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple, NoReturn

from kubernetes.client.rest import ApiException

from multiworld.contract import BrokenWorldReport, WorkerStatus, WorldTable
from multiworld_operator.channel_server import ChannelServer, Speaker
from multiworld_operator.kube.client.api import KubeApi, gather_bounded
from multiworld_operator.kube.client.api_basics import api_message
from multiworld_operator.kube.memory.configmap_writer import ConfigMapWriter
from multiworld_operator.kube.memory.memory_store import PlannerMemoryStore
from multiworld_operator.kube.metrics.registry import OperatorMetrics
from multiworld_operator.kube.objects.bodies import plays_labels, pod_body, rendezvous_host, selector
from multiworld_operator.kube.objects.networking import Networking
from multiworld_operator.kube.objects.observe import ObservedPods, SeenPod, observe_pods, pod_addresses
from multiworld_operator.kube.objects.pod_cache import PodCache
from multiworld_operator.kube.objects.ports import world_ports
from multiworld_operator.kube.reporting.errors import CreateRefused, StepFailed, failing_as, not_ours, step_failure
from multiworld_operator.kube.reporting.events import MultiWorldEvents
from multiworld_operator.kube.reporting.refusal import CREATE_REFUSED, INVALID_SPEC
from multiworld_operator.kube.reporting.status_writer import StatusWriter
from multiworld_operator.kube.workers.lost_hosts import NODE_LOST, LostHosts
from multiworld_operator.kube.workers.worker_inbox import REPORT_REFUSED, WorkerInbox
from multiworld_operator.planner import CreatePod, EmitEvent, MultiWorldStatus, Observation, Plan, plan
from multiworld_operator.spec import MultiWorld, SpecError, parse_manifest
from multiworld_operator.world_secrets import WorldSecrets, new_key

log = logging.getLogger(__name__)


class Planned(NamedTuple):
    """A step's plan: the last one, the pods it saw, the pods to delete (name -> uid), those of
    them replaced for their silence (uids) and the Events of every plan."""

    result: Plan
    seen: ObservedPods
    deletes: dict[str, str]
    silent: set[str]
    events: list[EmitEvent]


# Plans per step: a plan that deleted pods is followed by one that replaces them.
REPLANS = 3
# How long after the operator starts, or takes the lead, its workers may still be reconnecting
# (a refused worker retries after at most 10 s: multiworld.channels.stream).
RECONNECT_GRACE_S = 12.0


class Reconciler:
    """Reconciles one MultiWorld. `body` is its latest manifest as watched. What this reconciler
    wrote (the memory, the status view) is remembered, since a watched body may lag behind our
    own writes. The table goes to the workers through `channel`, which pods reach at
    `channel_url`; until `reconnect_until` (time.monotonic()) its workers may be reconnecting.
    `world_key`: the operator's key, which every world's secret derives from (None: a fresh one)."""

    def __init__(
        self,
        api: KubeApi,
        body: Mapping[str, Any],
        channel: ChannelServer,
        metrics: OperatorMetrics,
        channel_url: str,
        reconnect_until: float = 0.0,
        world_key: bytes | None = None,
    ) -> None:
        self.api = api
        self.world_key = world_key or new_key()
        self.metrics = metrics
        self.reconnect_until = reconnect_until
        self.channel = channel
        self.channel_url = channel_url
        self.body: dict[str, Any] = dict(body)
        self._start_afresh()
        # The error the last steps failed with, reported once (None once a step succeeds).
        self.failing_with: str | None = None

    def _start_afresh(self) -> None:
        """Forget what was known of an earlier MultiWorld of this name."""
        namespace, name, uid = self.namespace, self.name, self.uid
        self.pods = PodCache(uid)
        self.inbox = WorkerInbox()
        # The memory, read once (see _load).
        self._read_again()
        self.status = StatusWriter(self.api, namespace, name, self.body.get("status"))
        self.networking = Networking(self.api, namespace, name, uid)
        self.events = MultiWorldEvents(self.api, self.body)
        # A MultiWorld made again under this name (a new uid) shares no secret with the one before.
        self.secrets = WorldSecrets(self.world_key, f"{namespace}/{name}/{uid}")
        self.lost = LostHosts()
        self._parsed: tuple[tuple[str, int | None], MultiWorld] | None = None

    @property
    def key(self) -> tuple[str, str]:
        """This MultiWorld's group on the worker channel."""
        return self.namespace, self.name

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
            self._start_afresh()
        return renewed or new.get("generation") != old.get("generation") or self.deleting

    def pod_changed(self, deleted: bool, pod: Mapping[str, Any]) -> bool:
        """A pod of this MultiWorld as the watch reported it; True when it is news."""
        return self.pods.changed(deleted, pod)

    def worker_status(self, speaker: Speaker, status: WorkerStatus) -> bool:
        """What a pod's worker holds now; True when it is news for the planner."""
        return self.pods.ours(speaker.pod, speaker.uid) and self.inbox.status(speaker.uid, status, self._published)

    def worker_report(self, speaker: Speaker, report: BrokenWorldReport) -> bool:
        """A pod's worker saw a world break; True when the report counts (or waits for the table
        to be known) or was refused (to be said on the MultiWorld)."""
        if not self.pods.ours(speaker.pod, speaker.uid):
            return False  # an instance already replaced: what it saw is history
        self.inbox.report(speaker.pod, report, self._published)
        return True

    def worker_lost(self, speaker: Speaker) -> bool:
        """A pod's worker stopped answering with its host (the channel's probes went unanswered:
        that instance's, current or replaced lately); True when it is news: that instance has
        ended, and every other on its node, which is kept out of new pods (lost_hosts.py)."""
        node = next((pod.node for pod in self.pods.pods() if pod.uid == speaker.uid), "")
        news = self.lost.lost(speaker.uid, speaker.pod, node, datetime.now(UTC))
        if news:
            log.warning("pod %s (%s) lost with its node", speaker.pod, speaker.uid)
        return news

    @property
    def _published(self) -> WorldTable | None:
        """The table as last published (None until the memory is read)."""
        remembered = self.memory.remembered if self.memory.loaded else None
        return remembered.table if remembered is not None else (WorldTable() if self.memory.loaded else None)

    def network_policy_changed(self, deleted: bool, policy: Mapping[str, Any]) -> bool:
        """The NetworkPolicy changed: True when it is no longer as made (the next step restores it)."""
        return self.networking.policy_changed(deleted, policy)

    def service_deleted(self, service: Mapping[str, Any]) -> bool:
        """A Service labelled for this MultiWorld went: True when it was its own (the next step
        creates it again)."""
        return self.networking.service_deleted(service)

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
        try:
            return await self._step()
        except StepFailed as error:
            if error.conflict:
                self._read_again()
            raise

    async def _step(self) -> float | None:
        if self.deleting:
            return None
        body = self.body
        try:
            multiworld = self._multiworld(body)
        except SpecError as error:
            await self._refuse(body, error.problems)
            return None
        self.events.allow_for(len(multiworld.spec.worlds))
        with failing_as("reading the operator's memory"):
            await self._load(multiworld)
        if self.pods.stale():
            with failing_as("listing the pods"):
                self.pods.listed(*await self.api.list_pods(self.namespace, selector(self.name)))
        with failing_as("making the Service and the NetworkPolicy"):
            taken = await self.networking.ensure_service(body)
            if taken:
                await self._refused([taken])
            taken = await self.networking.ensure_network_policy(body, multiworld)
            if taken:
                await self._refused([taken])
        # The planner runs off the event loop: a MultiWorld of thousands of pods plans for a
        # while, and every other MultiWorld's loop goes on meanwhile.
        pods = self.pods.pods()
        workers, reports = self.inbox.current(
            self._published or WorldTable(), {pod.uid for pod in pods}, pod_addresses(pods)
        )
        previous = self.memory.remembered
        placed = {pod.uid: pod.node for pod in pods}
        lost = self.lost.reasons(placed)
        lost_nodes = self.lost.lost_at(datetime.now(UTC))
        planned = await asyncio.to_thread(
            self._plan_step, multiworld, previous, pods, workers, reports, lost, lost_nodes
        )
        result, seen = planned.result, planned.seen
        with failing_as(f"storing the operator's memory (ConfigMap {self.name})"):
            refused = await self.memory.remember(body, result.status)
        if refused:
            await self._refused([refused])  # nothing goes out before the memory
        self.metrics.step_taken(self.key, previous, result.status)
        for uid in planned.deletes.values():  # its connection, probed on, may yet say its node is lost
            self.lost.replaced(uid, placed.get(uid, ""), datetime.now(UTC), silent=uid in planned.silent)
        with failing_as("deleting pods"):
            await gather_bounded(self._delete_pod(pod, uid) for pod, uid in planned.deletes.items())
        # An instance no longer its pod's gets no later table (and no world's later secret).
        self.channel.keep_only(self.key, self.pods.ours)
        self.channel.publish(self.secrets.table(result.table), self.key)
        with failing_as("creating pods"):
            failures = [f for f in await gather_bounded(self._create(body, c, seen) for c in result.creates) if f]
        with failing_as("labelling warm spares"):
            await self._label_spares(multiworld, result.status)
        with failing_as("writing the status"):
            await self.status.show(result.status)
        await gather_bounded(self.events.post(e.type, e.reason, e.message, e.world, e.epoch) for e in planned.events)
        await gather_bounded(self.events.post("Warning", NODE_LOST, m) for m in self.lost.take_news())
        await gather_bounded(self.events.post("Warning", REPORT_REFUSED, m) for m in self.inbox.take_refusals())
        if failures:
            await self._refused(failures)
        if self._reconnecting():  # look again once silent pods may count as joined
            grace_left = self.reconnect_until - time.monotonic()
            return grace_left if result.requeue_after is None else min(result.requeue_after, grace_left)
        return result.requeue_after

    def _plan_step(
        self,
        multiworld: MultiWorld,
        previous: MultiWorldStatus | None,
        pods: list[SeenPod],
        workers: Mapping[str, WorkerStatus],
        reports: list[BrokenWorldReport],
        lost: Mapping[str, str],
        lost_nodes: Mapping[str, datetime],
    ) -> Planned:
        """The step's plan, in a worker thread (pure: it only reads its arguments). A plan that
        deletes pods is followed by one from its status that sees them gone, so that their
        replacements are created in this step rather than on the next watch event; the last
        plan's status (the memory, stored before any delete) accounts for every delete. `lost`: pod
        uid -> why that instance is lost with its host; `lost_nodes`: the nodes lost lately, and
        when (lost_hosts.py)."""
        deletes: dict[str, str] = {}
        silent: set[str] = set()
        events: list[EmitEvent] = []
        for _ in range(REPLANS):
            seen = observe_pods(pods, workers, reports, silent_is_unjoined=self._reconnecting(), lost=lost)
            result = self._plan(multiworld, previous, seen, lost_nodes)
            events += result.events
            batch = {
                d.pod: seen.present[d.pod]
                for d in result.deletes
                if d.pod in seen.present and d.pod not in seen.terminating and d.pod not in deletes
            }
            if not batch:
                break
            for delete in result.deletes:
                if delete.pod in batch:
                    log.info("deleting pod %s (%s)", delete.pod, delete.reason)
            deletes.update(batch)
            silent.update(batch[d.pod] for d in result.deletes if d.silent and d.pod in batch)
            pods = [pod for pod in pods if pod.name not in batch]  # deleted at once (below)
            previous = result.status
        return Planned(result, seen, deletes, silent, events)

    def _reconnecting(self) -> bool:
        """Whether this operator started (or took the lead) on a MultiWorld it already ran so
        recently that its workers may not have reconnected yet (their statuses live in the
        operator's memory only): a silent pod then counts as not joined, so that no world counts
        as formed on statuses it has not heard."""
        return time.monotonic() < self.reconnect_until

    def _read_again(self) -> None:
        """Someone else wrote the memory's ConfigMap meanwhile: forget what was written, so the
        next step reads the memory again and plans from it."""
        self.memory = PlannerMemoryStore(
            self.api, self.namespace, self.name, self.uid, ConfigMapWriter(self.api, self.namespace)
        )

    async def _load(self, multiworld: MultiWorld) -> None:
        """Once: the memory."""
        if not self.memory.loaded:
            await self.memory.load(self.status.view, multiworld)
            if self.memory.remembered is None:
                self.reconnect_until = 0.0  # a MultiWorld new to the operator: no worker to wait for

    def _plan(
        self,
        multiworld: MultiWorld,
        previous: MultiWorldStatus | None,
        seen: ObservedPods,
        lost_nodes: Mapping[str, datetime],
    ) -> Plan:
        ports = world_ports(multiworld, previous.table if previous else None)
        return plan(
            multiworld,
            previous,
            Observation(now=datetime.now(UTC), pods=seen.pods, reports=seen.reports, lost_nodes=dict(lost_nodes)),
            endpoint=lambda world, rank0: (rendezvous_host(self.name, rank0), ports[world]),
        )

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
            log.info("deleting pod %s at once (replaced)", create.pod)
            await self._delete_pod(create.pod, seen.present[create.pod])
        if create.pod in seen.present:
            return None  # created once the old instance (or an older MultiWorld's pod) is gone
        try:
            now = datetime.now(UTC)
            created = await self.api.create_pod(
                self.namespace,
                pod_body(
                    self.secrets.create(create),
                    body,
                    self.channel_url,
                    avoid_nodes=self.lost.avoid(now),
                    prefer_off=self.lost.suspected(now),
                ),
            )
        except ApiException as error:
            if error.status is not None and error.status >= 500:
                raise
            return f"pod {create.pod}: {api_message(error)}"
        if created is not None:
            self.pods.changed(False, created)
            return None
        return not_ours("pod", create.pod, await self.api.read_pod(self.namespace, create.pod), self.uid)

    async def _label_spares(self, multiworld: MultiWorld, status: MultiWorldStatus) -> None:
        """A warm spare that plays a member pod says which in its labels, for people (its
        worker learns it from the table, published before)."""
        if not status.played_by:
            return
        plays = {pod.name: pod.plays for pod in self.pods.pods()}

        async def label(pod: str, spare: str) -> None:
            _, ordinal = multiworld.member_of_pod(pod)
            patched = await self.api.label_pod(self.namespace, spare, plays_labels(pod, ordinal))
            if patched is not None:
                self.pods.changed(False, patched)

        await gather_bounded(
            label(pod, spare) for pod, spare in status.played_by.items() if plays.get(spare, pod) != pod
        )

    async def _refuse(self, body: Mapping[str, Any], problems: list[str]) -> None:
        message = await self.status.show_refusal(body["metadata"].get("generation"), problems)
        if message is not None:
            await self.events.post("Warning", INVALID_SPEC, message)

    async def report_error(self, error: Exception) -> None:
        """A failed step shows in the status (the condition Reconciled False) and as one Warning
        Event (refused creates have theirs already), once per distinct message rather than once
        per retry, not only in the operator's log."""
        reason, message = step_failure(error)
        if reason != CREATE_REFUSED and message != self.failing_with:
            await self.events.post("Warning", reason, message)
        self.failing_with = message
        await self.status.show_error(reason, message)  # a failed step may have stored the planner's status first

    async def _refused(self, failures: list[str]) -> NoReturn:
        """Creates the API refused (a template Kubernetes rejects, a quota, RBAC) or names taken
        by objects not ours: an Event once per distinct refusal, then the loop retries with a
        backoff."""
        await self.events.warn_once(CREATE_REFUSED, failures)
        raise CreateRefused("; ".join(failures))
