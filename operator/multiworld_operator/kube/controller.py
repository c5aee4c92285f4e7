"""One reconcile loop per MultiWorld, woken by watch events (the loop shape of the local runner).

Each loop runs its Reconciler's steps one at a time (that is the per-MultiWorld lock: two
steps of one MultiWorld never overlap), and waits between steps for a wake-up (its MultiWorld,
one of its pods or its Service changed), for the planner's `requeue_after`, after an error for
a growing backoff, or at the latest for a periodic resync that makes up for any missed event.
Every failed step shows on its MultiWorld (Reconciler.report_error: the Reconciled condition,
and a Warning Event when the failure is new), not only in this log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any, cast

from kubernetes.client.rest import ApiException

from multiworld.contract import BrokenWorldReport, WorkerStatus
from multiworld_operator.kube.api_basics import Backoff, api_message

from ..channel_server import ChannelServer, Speaker
from .api import KubeApi
from .channel_settings import ChannelSettings
from .errors import CreateRefused, MultiWorldGone, StepFailed
from .reconcile import Reconciler
from .worker_identity import PodIdentities

log = logging.getLogger(__name__)

RESYNC_S = 60.0
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0

Key = tuple[str, str]


class ReconcileLoop:
    def __init__(self, reconciler: Reconciler) -> None:
        self.reconciler = reconciler
        self.wake = asyncio.Event()
        self.backoff = Backoff(BACKOFF_FIRST_S, BACKOFF_MAX_S)
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"reconcile {self.key}")

    @property
    def key(self) -> Key:
        return self.reconciler.namespace, self.reconciler.name

    def poke(self) -> None:
        self.wake.set()

    async def _run(self) -> None:
        wait: float | None = 0.0
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), RESYNC_S if wait is None else wait)
            self.wake.clear()
            try:
                wait = await self.reconciler.step()
                self.backoff.reset()
                self.reconciler.failing_with = None
            except MultiWorldGone:
                log.info("%s/%s: gone; reconcile loop ends", *self.key)
                return
            except (ApiException, CreateRefused, StepFailed, OSError) as error:
                wait = self._backoff(error)
                await self._report(error)
            except Exception as error:  # a bug must not end the loop of this MultiWorld for good
                log.exception("%s/%s: reconcile step failed", *self.key)
                wait = self._backoff(None)
                await self._report(error)

    async def _report(self, error: Exception) -> None:
        try:
            await self.reconciler.report_error(error)
        except (ApiException, OSError, MultiWorldGone) as failure:  # best effort: the step is retried anyway
            log.warning("%s/%s: could not report the failed step: %s", *self.key, failure)

    def _backoff(self, error: BaseException | None) -> float:
        delay = self.backoff.next()
        if error is not None:
            reason = api_message(error) if isinstance(error, ApiException) else str(error)
            log.warning("%s/%s: reconcile step failed (%s); retrying in %gs", *self.key, reason, delay)
        return delay

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class Controller:
    """Every MultiWorld this operator serves, by (namespace, name), and the worker channel their
    pods reach it by (tables out, statuses and reports in: a message wakes its MultiWorld's loop
    when it is news)."""

    def __init__(self, api: KubeApi) -> None:
        self.api = api
        self.loops: dict[Key, ReconcileLoop] = {}
        self.channel = ChannelServer(
            self._worker_report, self._worker_status, PodIdentities(api, self._locate).authenticate
        )
        self.channel_url = ""

    async def start(self, settings: ChannelSettings) -> int:
        """Serve the worker channel on every address, as `settings` say; the port listened on."""
        listened = await self.channel.start("0.0.0.0", settings.port)
        self.channel_url = settings.url_for(listened)
        log.info("worker channel on port %d; pods connect to %s", listened, self.channel_url)
        return listened

    def _locate(self, namespace: str, pod: str, uid: str) -> Key | None:
        """The MultiWorld whose pod that instance is."""
        for key, loop in self.loops.items():
            if key[0] == namespace and loop.reconciler.pods.ours(pod, uid):
                return key
        return None

    def _worker_status(self, speaker: Speaker, status: WorkerStatus) -> None:
        loop = self.loops.get(cast(Key, speaker.group))
        if loop is not None and loop.reconciler.worker_status(speaker, status):
            loop.poke()

    def _worker_report(self, speaker: Speaker, report: BrokenWorldReport) -> None:
        loop = self.loops.get(cast(Key, speaker.group))
        if loop is not None and loop.reconciler.worker_report(speaker, report):
            loop.poke()

    async def multiworld_changed(self, body: Mapping[str, Any], deleted: bool) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        loop = self.loops.get(key)
        if deleted:
            if loop is not None and loop.reconciler.uid == body["metadata"]["uid"]:
                del self.loops[key]
                self.channel.forget(key)
                await loop.stop()
            return
        if loop is None or loop.task.done():
            self.loops[key] = ReconcileLoop(Reconciler(self.api, body, self.channel, self.channel_url))
            return
        if loop.reconciler.update(body):
            loop.poke()

    def pod_changed(self, namespace: str, multiworld: str, deleted: bool, pod: Mapping[str, Any]) -> None:
        loop = self.loops.get((namespace, multiworld))
        if loop is not None and loop.reconciler.pod_changed(deleted, pod):
            loop.poke()

    def network_policy_changed(self, namespace: str, multiworld: str, deleted: bool, policy: Mapping[str, Any]) -> None:
        loop = self.loops.get((namespace, multiworld))
        if loop is not None and loop.reconciler.network_policy_changed(deleted, policy):
            loop.poke()

    def service_deleted(self, namespace: str, multiworld: str) -> None:
        loop = self.loops.get((namespace, multiworld))
        if loop is not None:
            loop.reconciler.service_deleted()
            loop.poke()

    async def stop(self) -> None:
        loops, self.loops = list(self.loops.values()), {}
        for loop in loops:
            await loop.stop()
        await self.channel.close()
