"""Leader election on a `coordination.k8s.io/v1` Lease: of the operator's replicas, one acts.

Every replica runs kopf's watches and keeps the latest MultiWorlds (controller.py); only the
holder of the Lease runs reconcile loops. The loop here, every `renew_every_s`:
- reads the Lease. A replica takes it when it is free (no holder: released) or when its
  record has not changed for `leaseDurationSeconds` as this replica's own clock measures from
  the moment it first saw that record (client-go's rule: no two clocks are compared, so clock
  skew between nodes cannot hand the Lease over early); the holder renews it. Every write is a
  replace at the resourceVersion just read, so of two replicas taking it at once one gets a 409
  and stays standby.
- A leader that cannot renew for `renew_deadline_s` (two thirds of the duration), or finds
  someone else holding the Lease (or loses a renew to a write of someone else's), steps down
  at once: its loops are cancelled, then `on_lost`
  ends the process (main.py exits non-zero and the pod restarts as a standby). Its deadline
  counts from just before its last successful renew was sent, and a standby's lapse from just
  after it saw that renew, so the old leader stops at least a third of the duration before
  anyone else may take over.
- A leader shutting down (kopf's cleanup) stops its loops, then clears the holder: a standby
  takes the Lease on its next read instead of waiting out the duration.

The replica's own pod (POD_NAMESPACE/POD_NAME from the downward API) carries the label
LEADER_LABEL while it leads and not otherwise, so that a Service selecting it reaches the
leader only. The label is best effort: a failed patch is retried on the next tick and never
holds up acting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import urllib3
from kubernetes.client.rest import ApiException

from multiworld_operator.kube.client.api_basics import api_message

log = logging.getLogger(__name__)

LEADER_LABEL = "multiworld.io/operator-leader"
LEASE_DURATION_S = 15
# The leader renews, and a standby looks, this often at most.
RENEW_EVERY_S = 2.0


@dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    duration_s: int = LEASE_DURATION_S
    # The replica's own pod (namespace, name), labelled while it leads; None outside a pod.
    own_pod: tuple[str, str] | None = None

    @classmethod
    def from_env(cls, namespace: str | None, name: str, duration_s: int) -> LeaseConfig:
        """The identity is the pod's name (the downward API's POD_NAME), else hostname and pid:
        two replicas never share one. A container restarted in the same pod keeps the name,
        and may take up the Lease it held at once: its old process is gone."""
        pod, pod_namespace = os.environ.get("POD_NAME"), os.environ.get("POD_NAMESPACE")
        namespace = namespace or pod_namespace
        if not namespace:
            raise ValueError("leader election needs the Lease's namespace: --lease-namespace or $POD_NAMESPACE")
        identity = pod or f"{socket.gethostname()}-{os.getpid()}"
        own_pod = (pod_namespace, pod) if pod and pod_namespace else None
        return cls(namespace, name, identity, duration_s, own_pod)

    @property
    def renew_every_s(self) -> float:
        return min(RENEW_EVERY_S, self.duration_s / 5)

    @property
    def renew_deadline_s(self) -> float:
        return self.duration_s * 2 / 3

    @property
    def request_timeout_s(self) -> float:
        """A Lease request in flight longer than this is given up (its thread ends with it)."""
        return 2 * self.renew_every_s


class LeaseApi(Protocol):
    """The calls the Lease's loop makes (KubeApi's)."""

    async def read_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None: ...

    async def replace_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None: ...

    async def label_pod(self, namespace: str, name: str, labels: Mapping[str, str | None]) -> dict[str, Any] | None: ...


class Actor(Protocol):
    """What leads: the Controller."""

    async def lead(self, may_act: Callable[[], bool]) -> None: ...

    async def step_down(self) -> None: ...


# A request that failed: refused, or no answer in time.
FAILURES = (ApiException, urllib3.exceptions.HTTPError, OSError)


def _reason(error: BaseException) -> str:
    return api_message(error) if isinstance(error, ApiException) else str(error) or type(error).__name__


def _now() -> str:
    """A MicroTime, as the Lease's acquireTime and renewTime hold it."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Leadership:
    """Acquires, renews and releases the Lease for `actor`; `on_lost` is called once the actor
    stepped down because the Lease was lost (not on a release)."""

    def __init__(self, api: LeaseApi, config: LeaseConfig, actor: Actor, on_lost: Callable[[], None]) -> None:
        self.api = api
        self.config = config
        self.actor = actor
        self.on_lost = on_lost
        self.leading = False
        # The last successful renew (monotonic, taken before its request went out).
        self._renewed_at = 0.0
        # The Lease as last read or written, and when (monotonic) its resourceVersion was first seen.
        self._lease: dict[str, Any] | None = None
        self._seen: tuple[str, float] = ("", 0.0)
        # Whether the own pod carries LEADER_LABEL; None: not known yet (a fresh start).
        self._labelled: bool | None = None
        self._task: asyncio.Task[None] | None = None

    def may_act(self) -> bool:
        """Leading, and renewed within the deadline: a process frozen past it (SIGSTOP, a
        starved CPU) finds this False the moment it runs again, before its next renew."""
        return self.leading and time.monotonic() - self._renewed_at < self.config.renew_deadline_s

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"lease {self.config.name}")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A Lease loop that died of a bug renews nothing more: end the process as for a lost
        Lease (its loops already stop stepping once the renew deadline passes: may_act)."""
        if not task.cancelled() and task.exception() is not None:
            log.error("lease %s: its loop failed", self.config.name, exc_info=task.exception())
            self.on_lost()

    async def stop(self) -> None:
        """Shutting down: the actor stops first, then the Lease is released (the standby takes
        it at once), and the pod's label goes."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.leading:
            self.leading = False
            await self.actor.step_down()
            await self._label(False)
            await self._release()

    async def _run(self) -> None:
        await self._label(False)  # a replica starts as a standby, whatever its pod said before
        while await self._tick():
            if self.config.own_pod is not None and self._labelled is not self.leading:  # one that failed is retried
                await self._label(self.leading)
            await asyncio.sleep(self.config.renew_every_s)

    async def _tick(self) -> bool:
        """One look at the Lease; False once it was lost (the actor stepped down)."""
        attempted = time.monotonic()
        try:
            # A leader's attempt may last until its deadline; a standby's is bounded by the requests.
            deadline = self._renewed_at + self.config.renew_deadline_s - attempted if self.leading else None
            held = await asyncio.wait_for(self._try_hold(attempted), deadline)
        except (*FAILURES, TimeoutError) as error:
            log.warning("lease %s/%s: %s", self.config.namespace, self.config.name, _reason(error))
            if not self.leading or time.monotonic() - self._renewed_at < self.config.renew_deadline_s:
                return True
            log.error("lease %s: not renewed for %gs", self.config.name, self.config.renew_deadline_s)
            held = False
        if held:
            self._renewed_at = attempted
            if not self.leading:
                log.info("lease %s: %s leads", self.config.name, self.config.identity)
                self.leading = True
                await self.actor.lead(self.may_act)
            return True
        if not self.leading:
            return True
        self.leading = False
        await self.actor.step_down()
        log.error("lease %s: lost (held by %s); stepped down, exiting", self.config.name, self._holder() or "nobody")
        await self._label(False)
        self.on_lost()
        return False

    def _holder(self) -> str:
        return str(((self._lease or {}).get("spec") or {}).get("holderIdentity") or "")

    async def _try_hold(self, attempted: float) -> bool:
        """Read the Lease and take or renew it if it is ours to hold; True when held now."""
        namespace, name, me = self.config.namespace, self.config.name, self.config.identity
        lease = await self.api.read_lease(namespace, name)
        if lease is None:
            self._lease = await self.api.create_lease(namespace, self._body(None))
            return self._lease is not None
        self._lease = lease
        version = str(lease["metadata"]["resourceVersion"])
        if version != self._seen[0]:
            self._seen = (version, attempted)
        spec = lease.get("spec") or {}
        holder = self._holder()
        lapsed = attempted - self._seen[1] >= float(spec.get("leaseDurationSeconds") or self.config.duration_s)
        if holder != me and (self.leading or (holder and not lapsed)):
            return False
        written = await self.api.replace_lease(namespace, self._body(lease))
        if written is not None:
            self._lease = written
        return written is not None

    def _body(self, lease: dict[str, Any] | None) -> dict[str, Any]:
        """The Lease held by this replica, renewed now (taken now when it held it not)."""
        now = _now()
        spec = (lease or {}).get("spec") or {}
        ours = spec.get("holderIdentity") == self.config.identity
        metadata: dict[str, Any] = {"name": self.config.name, "namespace": self.config.namespace}
        if lease is not None:
            metadata["resourceVersion"] = lease["metadata"]["resourceVersion"]
        transitions = int(spec.get("leaseTransitions") or 0)
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": self.config.identity,
                "leaseDurationSeconds": self.config.duration_s,
                "acquireTime": spec.get("acquireTime") if ours else now,
                "renewTime": now,
                "leaseTransitions": transitions if ours or lease is None else transitions + 1,
            },
        }

    async def _release(self) -> None:
        """Clear the holder at the resourceVersion last written: a Lease written meanwhile is
        someone else's already and is left alone."""
        if self._lease is None or self._holder() != self.config.identity:
            return
        spec = {**self._lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _now()}
        try:
            released = await self.api.replace_lease(self.config.namespace, {**self._lease, "spec": spec})
        except FAILURES as error:
            log.warning("lease %s: not released (%s); a standby waits out its lapse", self.config.name, _reason(error))
            return
        if released is not None:
            log.info("lease %s: released by %s", self.config.name, self.config.identity)

    async def _label(self, leading: bool) -> None:
        """Make the own pod carry LEADER_LABEL exactly while leading (best effort)."""
        if self.config.own_pod is None:
            return
        namespace, pod = self.config.own_pod
        try:
            await self.api.label_pod(namespace, pod, {LEADER_LABEL: "true" if leading else None})
        except FAILURES as error:
            what = "set" if leading else "remove"
            log.warning("pod %s/%s: could not %s its leader label: %s", namespace, pod, what, _reason(error))
            self._labelled = None
            return
        self._labelled = leading
