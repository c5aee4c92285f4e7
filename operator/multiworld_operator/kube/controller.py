"""One reconcile loop per MultiWorld, woken by watch events (the loop shape of the local runner).

Each loop runs its Reconciler's steps one at a time (that is the per-MultiWorld lock: two
steps of one MultiWorld never overlap), and waits between steps for a wake-up (its MultiWorld,
one of its pods or its Service changed, a worker's report or status was news), for the
planner's `requeue_after`, after an error for a growing backoff, or at the latest for a
periodic resync that makes up for any missed event. A worker's status wakes it no sooner than
MIN_STATUS_STEP_S after its last step began: a worker may change its status as often as the
channel lets it, and a step may write the status and the memory.
Every failed step shows on its MultiWorld (Reconciler.report_error: the Reconciled condition,
and a Warning Event when the failure is new), not only in this log.

Loops run only while this replica leads (leadership.py; without leader election it leads from
the start). A standby keeps the latest body of every MultiWorld and nothing else: on taking
over, each loop starts afresh (its Reconciler reads the memory, the table and the pods anew,
since the old leader wrote them meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from kubernetes.client.rest import ApiException

from multiworld.contract import BrokenWorldReport, WorkerStatus
from multiworld_operator.channel_server import ChannelServer, Speaker
from multiworld_operator.kube.client.api import KubeApi
from multiworld_operator.kube.client.api_basics import Backoff, api_message
from multiworld_operator.kube.metrics.registry import OperatorMetrics
from multiworld_operator.kube.reconcile import RECONNECT_GRACE_S, Reconciler
from multiworld_operator.kube.reporting.errors import CreateRefused, MultiWorldGone, StepFailed
from multiworld_operator.kube.workers.channel_settings import ChannelSettings
from multiworld_operator.kube.workers.worker_identity import PodIdentities
from multiworld_operator.log_context import multiworld_bound
from multiworld_operator.world_secrets import new_key

log = logging.getLogger(__name__)

RESYNC_S = 60.0
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
# How soon a loop looks again when it may not act (its leader's Lease is overdue for renewal).
MAY_ACT_POLL_S = 0.5
# A step for a worker's status news begins at least this long after the step before.
MIN_STATUS_STEP_S = 0.2

Key = tuple[str, str]


def _always() -> bool:
    return True


class ReconcileLoop:
    """Steps of one Reconciler, each only when `may_act()` (the Lease held and renewed in time),
    each timed in `metrics`."""

    def __init__(self, reconciler: Reconciler, metrics: OperatorMetrics, may_act: Callable[[], bool] = _always) -> None:
        self.reconciler = reconciler
        self.metrics = metrics
        self.may_act = may_act
        self.wake = asyncio.Event()
        self.backoff = Backoff(BACKOFF_FIRST_S, BACKOFF_MAX_S)
        # When the last step began, and the wake-up a status news waits for (if one does).
        self.stepped_at = 0.0
        self._later: asyncio.TimerHandle | None = None
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"reconcile {self.key}")

    @property
    def key(self) -> Key:
        return self.reconciler.namespace, self.reconciler.name

    def poke(self) -> None:
        self.wake.set()

    def poke_for_status(self) -> None:
        """Wake for a worker's status news: at once if the last step began MIN_STATUS_STEP_S
        ago, else then."""
        wait = self.stepped_at + MIN_STATUS_STEP_S - time.monotonic()
        if wait <= 0:
            self.wake.set()
        elif self._later is None:
            self._later = asyncio.get_running_loop().call_later(wait, self._woken_later)

    def _woken_later(self) -> None:
        self._later = None
        self.wake.set()

    async def _run(self) -> None:
        with multiworld_bound(*self.key):
            await self._steps()

    async def _steps(self) -> None:
        wait: float | None = 0.0
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a wait that completed
            # as it was cancelled (a poke in the moment the operator stops), and the loop would
            # go on for good.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RESYNC_S if wait is None else wait):
                    await self.wake.wait()
            self.wake.clear()
            # A leader that was frozen past its renew deadline (SIGSTOP, a starved CPU) may wake
            # here before its Lease loop does: it must not take a step then.
            if not self.may_act():
                wait = MAY_ACT_POLL_S
                continue
            self.stepped_at = time.monotonic()
            try:
                with self.metrics.step_duration.time():
                    wait = await self.reconciler.step()
                self.backoff.reset()
                self.reconciler.failing_with = None
            except MultiWorldGone:
                log.info("gone; reconcile loop ends")
                return
            except (ApiException, CreateRefused, StepFailed, OSError) as error:
                wait = self._backoff(error)
                await self._report(error)
            except Exception as error:  # a bug must not end the loop of this MultiWorld for good
                log.exception("reconcile step failed")
                wait = self._backoff(None)
                await self._report(error)

    async def _report(self, error: Exception) -> None:
        try:
            await self.reconciler.report_error(error)
        except (ApiException, OSError, MultiWorldGone) as failure:  # best effort: the step is retried anyway
            log.warning("could not report the failed step: %s", failure)

    def _backoff(self, error: BaseException | None) -> float:
        delay = self.backoff.next()
        if error is not None:
            reason = api_message(error) if isinstance(error, ApiException) else str(error)
            log.warning("reconcile step failed (%s); retrying in %gs", reason, delay)
        return delay

    async def stop(self) -> None:
        if self._later is not None:
            self._later.cancel()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class Controller:
    """Every MultiWorld this operator serves, by (namespace, name): the latest body of each, its
    reconcile loop while leading, and the worker channel their pods reach it by (tables out,
    statuses and reports in: a message wakes its MultiWorld's loop when it is news; a replica
    that does not lead runs no loop, so it refuses every worker, who retries: the channel's
    Service sends workers to the leader). `metrics` reads every MultiWorld's status from it.
    `world_key`: what every world's secrets derive from (world_key.py; None: a fresh one)."""

    def __init__(
        self, api: KubeApi, metrics: OperatorMetrics, leading: bool = True, world_key: bytes | None = None
    ) -> None:
        self.api = api
        self.metrics = metrics
        self.leading = leading
        self.world_key = world_key or new_key()
        self.may_act: Callable[[], bool] = _always
        self.bodies: dict[Key, Mapping[str, Any]] = {}
        self.loops: dict[Key, ReconcileLoop] = {}
        self.channel = ChannelServer(
            self._worker_report, self._worker_status, PodIdentities(api, self._locate).authenticate, self._worker_lost
        )
        self.channel_url = ""
        # Until then, workers may still be reconnecting to this replica (reconcile.py).
        self.reconnect_until = 0.0
        metrics.read_statuses_from(self)

    async def start(self, settings: ChannelSettings) -> int:
        """Serve the worker channel on every address, as `settings` say; the port listened on."""
        listened = await self.channel.start("0.0.0.0", settings.port)
        self.reconnect_until = time.monotonic() + RECONNECT_GRACE_S
        self.channel_url = settings.url_for(listened)
        log.info("worker channel listening on :%d; pods connect to %s", listened, self.channel_url)
        return listened

    def statuses(self) -> Iterator[tuple[Key, Mapping[str, Any] | None]]:
        """Every MultiWorld's status as last written (by this replica's loop) or watched."""
        for key, body in list(self.bodies.items()):
            loop = self.loops.get(key)
            yield key, loop.reconciler.status.view if loop is not None else body.get("status")

    def waiting(self) -> int:
        """MultiWorlds whose loop was woken and has not started its step yet."""
        return sum(loop.wake.is_set() for loop in list(self.loops.values()))

    def _locate(self, namespace: str, pod: str, uid: str) -> Key | None:
        """The MultiWorld whose pod that instance is."""
        for key, loop in self.loops.items():
            if key[0] == namespace and loop.reconciler.pods.ours(pod, uid):
                return key
        return None

    def _worker_status(self, speaker: Speaker, status: WorkerStatus) -> None:
        loop = self.loops.get(cast(Key, speaker.group))
        if loop is not None:
            with multiworld_bound(*loop.key):
                if loop.reconciler.worker_status(speaker, status):
                    loop.poke_for_status()

    def _worker_report(self, speaker: Speaker, report: BrokenWorldReport) -> None:
        loop = self.loops.get(cast(Key, speaker.group))
        if loop is not None:
            with multiworld_bound(*loop.key):
                if loop.reconciler.worker_report(speaker, report):
                    loop.poke()

    def _worker_lost(self, speaker: Speaker) -> None:
        loop = self.loops.get(cast(Key, speaker.group))
        if loop is not None:
            with multiworld_bound(*loop.key):
                if loop.reconciler.worker_lost(speaker):
                    loop.poke()

    async def multiworld_changed(self, body: Mapping[str, Any], deleted: bool) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        loop = self.loops.get(key)
        if deleted:
            known = self.bodies.get(key)
            if known is not None and known["metadata"]["uid"] == body["metadata"]["uid"]:
                del self.bodies[key]
            if loop is not None and loop.reconciler.uid == body["metadata"]["uid"]:
                del self.loops[key]
                self.channel.forget(key)
                self.metrics.forget(key)
                await loop.stop()
            return
        self.bodies[key] = body
        if not self.leading:
            return
        if loop is None or loop.task.done():
            self.loops[key] = self._loop(body)
            return
        if loop.reconciler.update(body):
            loop.poke()

    def _loop(self, body: Mapping[str, Any]) -> ReconcileLoop:
        reconciler = Reconciler(
            self.api, body, self.channel, self.metrics, self.channel_url, self.reconnect_until, self.world_key
        )
        return ReconcileLoop(reconciler, self.metrics, self.may_act)

    async def lead(self, may_act: Callable[[], bool]) -> None:
        """Leadership taken: a loop for every MultiWorld seen, each stepping only while `may_act()`."""
        self.leading, self.may_act = True, may_act
        self.reconnect_until = time.monotonic() + RECONNECT_GRACE_S
        for key, body in self.bodies.items():
            self.loops[key] = self._loop(body)

    async def step_down(self) -> None:
        """Leadership lost or given up: every loop is cancelled at once (before any of them is
        awaited, so none takes another step meanwhile)."""
        self.leading = False
        await self.stop()

    def pod_changed(self, namespace: str, multiworld: str, deleted: bool, pod: Mapping[str, Any]) -> None:
        loop = self.loops.get((namespace, multiworld))
        if loop is not None and loop.reconciler.pod_changed(deleted, pod):
            loop.poke()

    def network_policy_changed(self, namespace: str, multiworld: str, deleted: bool, policy: Mapping[str, Any]) -> None:
        loop = self.loops.get((namespace, multiworld))
        if loop is not None and loop.reconciler.network_policy_changed(deleted, policy):
            loop.poke()

    def service_deleted(self, namespace: str, multiworld: str, service: Mapping[str, Any]) -> None:
        loop = self.loops.get((namespace, multiworld))
        if loop is not None and loop.reconciler.service_deleted(service):
            loop.poke()

    async def stop(self) -> None:
        loops, self.loops = list(self.loops.values()), {}
        for loop in loops:
            loop.task.cancel()
        for loop in loops:
            await loop.stop()
        await self.channel.close()
