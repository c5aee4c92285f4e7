"""A kubelet stand-in for a cluster without nodes: it watches one namespace's MultiWorld pods,
notes when each instance appears, marks it Running START_S later, and marks a pod Failed on
request, both through the pod's status as a kubelet would. It counts its own API writes."""

from __future__ import annotations

import heapq
import json
import threading
import time
from dataclasses import dataclass

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from multiworld_operator.kube.client.api_basics import MERGE_PATCH
from multiworld_operator.kube.objects.bodies import CREATED_FOR_ANNOTATION, NAME_LABEL

# Watches are renewed this often, so stopping never waits longer.
WATCH_S = 5
# How long after a pod instance appears its container "starts" (is marked Running).
START_S = 0.5
# What the benches that use it say of their kubelet.
DESCRIBED = f"kubelet: a stand-in (status patches; a container 'starts' {START_S:g} s after its pod appears)"


@dataclass(frozen=True)
class Appeared:
    """A pod instance as the watch delivered its ADDED event (`at`: time.monotonic())."""

    at: float
    name: str
    created_for: dict[str, int]


class StandInKubelet:
    """Use as a context manager. `writes`: every API write it made (each a pod status patch,
    whatever its outcome, since the API server counts them all)."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.writes = 0
        self._writes_lock = threading.Lock()
        self.appeared: list[Appeared] = []
        self._seen = threading.Condition()
        self._due: list[tuple[float, str]] = []
        self._due_changed = threading.Condition()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch, name="kubelet watch", daemon=True),
            threading.Thread(target=self._start_containers, name="kubelet start", daemon=True),
        ]

    def __enter__(self) -> StandInKubelet:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        with self._due_changed:
            self._due_changed.notify_all()
        for thread in self._threads:
            thread.join(WATCH_S * 3)

    def _version_now(self) -> str:
        listing = self.core.list_namespaced_pod(self.namespace, label_selector=NAME_LABEL, limit=1)
        assert listing.metadata is not None
        return str(listing.metadata.resource_version)

    def _watch(self) -> None:
        version = self._version_now()
        while not self._stop.is_set():
            stream = watch.Watch().stream(
                self.core.list_namespaced_pod,
                self.namespace,
                label_selector=NAME_LABEL,
                resource_version=version,
                timeout_seconds=WATCH_S,
            )
            try:
                for event in stream:
                    at = time.monotonic()
                    pod: client.V1Pod = event["object"]
                    assert pod.metadata is not None and pod.metadata.resource_version is not None
                    version = pod.metadata.resource_version
                    if event["type"] == "ADDED":
                        self._appeared(at, pod)
            except ApiException as error:
                if error.status != 410:
                    raise
                # Our version left the API server's window: go on from now. A pod missed
                # meanwhile makes its waiter time out, loudly.
                version = self._version_now()

    def _appeared(self, at: float, pod: client.V1Pod) -> None:
        meta = pod.metadata
        assert meta is not None and meta.name is not None
        stamp = json.loads((meta.annotations or {}).get(CREATED_FOR_ANNOTATION, "{}"))
        with self._seen:
            self.appeared.append(Appeared(at, meta.name, stamp))
            self._seen.notify_all()
        with self._due_changed:
            heapq.heappush(self._due, (at + START_S, meta.name))
            self._due_changed.notify_all()

    def _start_containers(self) -> None:
        while not self._stop.is_set():
            with self._due_changed:
                wait = self._due[0][0] - time.monotonic() if self._due else None
                if wait is None or wait > 0:
                    self._due_changed.wait(wait)
                    continue
                _, name = heapq.heappop(self._due)
            self._set_phase(name, "Running")

    def _set_phase(self, pod: str, phase: str) -> None:
        with self._writes_lock:
            self.writes += 1
        try:
            self.core.patch_namespaced_pod_status(
                pod, self.namespace, {"status": {"phase": phase}}, _content_type=MERGE_PATCH
            )
        except ApiException as error:
            if error.status != 404:  # deleted before its container "started"
                raise

    def fail(self, pod: str) -> None:
        self._set_phase(pod, "Failed")

    def mark(self) -> int:
        """A position in `appeared`, for `wait_appeared(since=...)`."""
        with self._seen:
            return len(self.appeared)

    def wait_all_appeared(self, names: set[str], since: int, timeout: float) -> float:
        """When the last of pods `names` appeared after position `since` (time.monotonic())."""
        deadline = time.monotonic() + timeout
        with self._seen:
            while True:
                seen = {s.name: s.at for s in self.appeared[since:] if s.name in names}
                if len(seen) == len(names):
                    return max(seen.values())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{len(names) - len(seen)} of {len(names)} pods not created within {timeout:.0f} s"
                    )
                self._seen.wait(left)

    def wait_appeared(self, name: str, created_for: dict[str, int], since: int, timeout: float) -> Appeared:
        """The first instance of `name` stamped `created_for` that appeared after position `since`."""
        deadline = time.monotonic() + timeout
        with self._seen:
            while True:
                for seen in self.appeared[since:]:
                    if seen.name == name and seen.created_for == created_for:
                        return seen
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no pod {name} created for {created_for} within {timeout:.0f} s")
                self._seen.wait(left)
