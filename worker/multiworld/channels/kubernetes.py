"""The Kubernetes channel (MULTIWORLD_TABLE=kubernetes://NAMESPACE/NAME).

- Table: the world ConfigMaps labelled with this pod (multiworld.contract: one per world of the
  pod, each holding that world's entry), listed and watched (read-only: get, list, watch
  configmaps); `on_table` gets the pod's table whenever an entry changes, appears or goes, from
  a background thread. A failure in a world this pod is not in sends it nothing.
- Reports and status: annotations on the worker's own Pod (patch pods), which the operator
  reads: `multiworld.io/broken-world` (the latest BrokenWorldReport), `multiworld.io/broken-worlds`
  (the latest report per world, so reports at once never hide one another) and
  `multiworld.io/worker-status` (the WorkerStatus). Each report is also an Event on the Pod.

Credentials: the pod's ServiceAccount (in-cluster), else $KUBECONFIG or ~/.kube/config.
Imported only for kubernetes:// tables, so `import multiworld` never imports kubernetes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.config.config_exception import ConfigException
from pydantic import ValidationError

from multiworld.channels.base import TableCallback
from multiworld.contract import (
    ENV_TABLE,
    REPORT_ANNOTATION,
    REPORTS_ANNOTATION,
    STATUS_ANNOTATION,
    BrokenWorldReport,
    WorkerStatus,
    WorldEntry,
    WorldTable,
    pod_table_selector,
    table_entry,
)
from multiworld.kube_api import MERGE_PATCH, REQUEST_TIMEOUT_S, Backoff, api_message, event_body

log = logging.getLogger(__name__)

SCHEME = "kubernetes://"
# The server ends each watch after this long; the client gives up on a silent one a bit later.
WATCH_TIMEOUT_S = 240
WATCH_READ_TIMEOUT_S = WATCH_TIMEOUT_S + 30.0
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
# Where the kubelet reads a container's termination message (terminationMessagePath's default).
TERMINATION_LOG = Path("/dev/termination-log")
# The exit status of a worker the API refuses (sysexits' EX_NOPERM).
EXIT_REFUSED = 77


def api_client() -> client.ApiClient:
    """In-cluster credentials (the pod's ServiceAccount), else $KUBECONFIG or ~/.kube/config."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except ConfigException:
        return config.new_client_from_config()
    return client.ApiClient(configuration)


def parse_table_url(url: str) -> tuple[str, str]:
    """'kubernetes://NAMESPACE/NAME' -> (namespace, name)."""
    namespace, _, name = url.removeprefix(SCHEME).partition("/")
    if not url.startswith(SCHEME) or not namespace or not name or "/" in name:
        raise ValueError(f"{ENV_TABLE}={url!r}: expected {SCHEME}NAMESPACE/NAME")
    return namespace, name


class KubernetesChannel:
    """The worker side of the Kubernetes platform for pod `pod` of MultiWorld `url`."""

    def __init__(self, url: str, pod: str, api: client.ApiClient | None = None) -> None:
        self.namespace, self.name = parse_table_url(url)
        self.pod = pod
        api = api or api_client()
        api.user_agent = "multiworld-worker"
        self.core = client.CoreV1Api(api)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._wake_writer = threading.Condition(self._lock)
        self._reports: dict[str, BrokenWorldReport] = {}
        self._unsent_reports: list[BrokenWorldReport] = []
        self._unsent_status: WorkerStatus | None = None
        self._response: urllib3.BaseHTTPResponse | None = None
        self._pod_uid: str | None = None
        self._threads: list[threading.Thread] = []
        # Every byte the table's reads and watches brought in (for benchmarks and diagnostics).
        self.bytes_received = 0

    # -- the protocol ------------------------------------------------------------------------

    def start(self, on_table: TableCallback) -> None:
        """Follow the table (every new revision goes to `on_table`) and start sending."""
        for target, role in ((lambda: self._watch(on_table), "table"), (self._write, "reports")):
            thread = threading.Thread(target=target, name=f"multiworld-k8s-{role}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def report(self, report: BrokenWorldReport) -> None:
        """Queue a report for this pod's annotations (and an Event); never blocks."""
        with self._lock:
            self._reports[report.world] = report
            self._unsent_reports.append(report)
            self._wake_writer.notify()

    def status(self, status: WorkerStatus) -> None:
        """Queue this pod's WorkerStatus; only the latest unsent one is written."""
        with self._lock:
            self._unsent_status = status
            self._wake_writer.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Stop watching; what is queued gets one last attempt within `timeout`."""
        self._closed.set()
        with self._lock:
            response = self._response
            self._wake_writer.notify()
        if response is not None:
            response.shutdown()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- the table ---------------------------------------------------------------------------

    def _watch(self, on_table: TableCallback) -> None:
        follower = _TableFollower(on_table)
        selector = pod_table_selector(self.name, self.pod)
        backoff = Backoff(RETRY_FIRST_S, RETRY_MAX_S)
        while not self._closed.is_set():
            try:
                response = _raw(
                    self.core.list_namespaced_config_map,
                    self.namespace,
                    label_selector=selector,
                    _request_timeout=REQUEST_TIMEOUT_S,
                )
                self.bytes_received += len(response.data)
                listing = json.loads(response.data)
                follower.listed(listing.get("items") or [])
                self._follow(follower, selector, listing["metadata"]["resourceVersion"], backoff)
            except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as error:
                if self._closed.is_set():
                    return
                _exit_if_refused(
                    error, f"get, list and watch configmaps (its worlds' table entries in {self.namespace})"
                )
                delay = backoff.next()
                log.warning(
                    "watching the world table of %s/%s failed (%s); again in %gs",
                    self.namespace,
                    self.name,
                    _describe(error),
                    delay,
                )
                self._closed.wait(delay)

    def _follow(self, follower: _TableFollower, selector: str, resource_version: str, backoff: Backoff) -> None:
        """Watch from `resource_version` until the server ends the watch or the version is too
        old (then the caller lists afresh)."""
        while not self._closed.is_set():
            response = _raw(
                self.core.list_namespaced_config_map,
                self.namespace,
                label_selector=selector,
                watch=True,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=WATCH_TIMEOUT_S,
                _request_timeout=(REQUEST_TIMEOUT_S, WATCH_READ_TIMEOUT_S),
            )
            with self._lock:
                self._response = response
            if self._closed.is_set():
                return
            try:
                for line in self._lines(response):
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        return  # typically 410 Gone: list afresh
                    obj = event.get("object") or {}
                    resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        follower.changed(obj, deleted=event["type"] == "DELETED")
                    backoff.reset()
            finally:
                with self._lock:
                    self._response = None
                response.release_conn()

    def _lines(self, response: urllib3.BaseHTTPResponse) -> Any:
        """Newline-delimited JSON events of a watch response."""
        buffer = b""
        for chunk in response.stream(4096, decode_content=True):
            self.bytes_received += len(chunk)
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            yield from (line for line in complete if line.strip())

    # -- reports and status ------------------------------------------------------------------

    def _write(self) -> None:
        backoff = Backoff(RETRY_FIRST_S, RETRY_MAX_S)
        while True:
            with self._lock:
                while not (self._unsent_reports or self._unsent_status or self._closed.is_set()):
                    self._wake_writer.wait()
                reports, self._unsent_reports = self._unsent_reports, []
                status, self._unsent_status = self._unsent_status, None
                annotations = self._annotations(bool(reports), status)
            if not annotations:
                return  # closed, nothing left to send
            try:
                self._send(annotations, reports)
                backoff.reset()
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as error:
                if self._requeue(error, reports, status):
                    delay = backoff.next()
                    log.warning(
                        "pod %s: sending to the operator failed (%s); again in %gs", self.pod, _describe(error), delay
                    )
                    if self._closed.wait(delay):
                        return

    def _annotations(self, reports: bool, status: WorkerStatus | None) -> dict[str, str]:
        annotations = {}
        if reports:
            latest = max(self._reports.values(), key=lambda r: r.time)
            annotations[REPORT_ANNOTATION] = latest.model_dump_json()
            every = [r.model_dump(mode="json") for r in self._reports.values()]
            annotations[REPORTS_ANNOTATION] = json.dumps(every, separators=(",", ":"))
        if status is not None:
            annotations[STATUS_ANNOTATION] = status.model_dump_json()
        return annotations

    def _send(self, annotations: dict[str, str], reports: list[BrokenWorldReport]) -> None:
        # Raw JSON: the pod's uid is all we read back, and no model parses a whole pod status.
        response = _raw(
            self.core.patch_namespaced_pod,
            self.pod,
            self.namespace,
            {"metadata": {"annotations": annotations}},
            _content_type=MERGE_PATCH,
            _request_timeout=REQUEST_TIMEOUT_S,
        )
        self._pod_uid = json.loads(response.data)["metadata"]["uid"]
        for report in reports:
            self._post_event(report)

    def _requeue(self, error: BaseException, reports: list[BrokenWorldReport], status: WorkerStatus | None) -> bool:
        """Put back what failed to go out, unless it never can (this pod is gone)."""
        _exit_if_refused(error, f"patch pods (annotate its own Pod {self.namespace}/{self.pod})")
        if isinstance(error, ApiException) and error.status == 404:
            log.warning("pod %s is gone; dropping what it had to send", self.pod)
            return False
        with self._lock:
            self._unsent_reports = reports + self._unsent_reports
            if self._unsent_status is None:
                self._unsent_status = status
        return True

    def _post_event(self, report: BrokenWorldReport) -> None:
        """Best effort: the annotation is what the operator acts on."""
        peer = "" if report.peer_rank is None else f" (peer rank {report.peer_rank})"
        # The Event is on the spare's own Pod; the member it plays is what a reader looks for.
        playing = f" (pod {self.pod}, playing {report.plays})" if report.plays else ""
        message = f"world {report.world} epoch {report.epoch} broken{peer}{playing}: {report.reason}"
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": self.pod,
            "namespace": self.namespace,
            "uid": self._pod_uid,
        }
        body = event_body(involved, "Warning", "WorldBroken", message, "multiworld-worker")
        try:
            _raw(self.core.create_namespaced_event, self.namespace, body, _request_timeout=REQUEST_TIMEOUT_S)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as error:
            _exit_if_refused(error, "create events")
            log.warning("pod %s: event for world %s not posted (%s)", self.pod, report.world, _describe(error))


def _raw(method: Callable[..., object], *args: Any, **kwargs: Any) -> urllib3.BaseHTTPResponse:
    """A client call whose response is read as raw JSON (`_preload_content=False`): what comes
    back is urllib3's response, not the model the client's annotations name; bodies are plain
    dicts, which the client sends as they are."""
    return cast(urllib3.BaseHTTPResponse, method(*args, _preload_content=False, **kwargs))


def _exit_if_refused(error: BaseException, permission: str) -> None:
    """401 and 403 never heal by retrying: without its permissions the worker would never see a
    new epoch and its reports would never arrive. Say which permission and how to get it, on
    stderr and as the container's termination message, and end the process."""
    if not (isinstance(error, ApiException) and error.status in (401, 403)):
        return
    message = (
        f"multiworld: the Kubernetes API refused this worker ({error.status} {error.reason}): its ServiceAccount "
        f"may not {permission}. Run the pod as the ServiceAccount the chart creates for workers: "
        f"`serviceAccountName: multiworld-worker` in the MultiWorld's pod template (chart value workers.namespaces "
        f"must list this namespace)."
    )
    sys.stderr.write(message + "\n")  # not through logging: the message must show at any log level
    sys.stderr.flush()
    if TERMINATION_LOG.exists():  # the kubelet made it: this runs in a container
        try:
            TERMINATION_LOG.write_text(message)
        except OSError:
            pass  # not writable for this user: the pod's FallbackToLogsOnError policy reads stderr
    os._exit(EXIT_REFUSED)


def from_url(url: str, pod: str) -> KubernetesChannel:
    """The channel protocol's entry point (multiworld.channels.open_channel)."""
    return KubernetesChannel(url, pod)


class _TableFollower:
    """The pod's table: the entries of the world ConfigMaps that name it, handed to `on_table`
    as a WorldTable whenever one of them changes. Revisions count this follower's tables."""

    def __init__(self, on_table: TableCallback) -> None:
        self.on_table = on_table
        self.entries: dict[str, WorldEntry] = {}
        self.revision = 0

    def listed(self, items: list[dict[str, Any]]) -> None:
        entries = {}
        for item in items:
            entry = _entry(item)
            if entry is not None:
                entries[entry.name] = entry
        self._offer(entries)

    def changed(self, obj: dict[str, Any], deleted: bool) -> None:
        entry = _entry(obj)
        if entry is None:
            return
        entries = dict(self.entries)
        if deleted:
            entries.pop(entry.name, None)
        else:
            entries[entry.name] = entry
        self._offer(entries)

    def _offer(self, entries: dict[str, WorldEntry]) -> None:
        if entries == self.entries and self.revision:
            return
        self.entries = entries
        self.revision += 1
        table = WorldTable(revision=self.revision, worlds=sorted(entries.values(), key=lambda e: e.name))
        try:
            self.on_table(table)
        except Exception:  # the caller's bug must not stop the table from flowing
            log.exception("on_table failed for revision %d", table.revision)


def _entry(obj: dict[str, Any]) -> WorldEntry | None:
    try:
        return table_entry(obj)
    except ValidationError as error:
        log.warning(
            "ignoring an unreadable world table entry (ConfigMap %s): %s", obj.get("metadata", {}).get("name"), error
        )
        return None


def _describe(error: BaseException) -> str:
    if isinstance(error, ApiException):
        return api_message(error)
    return f"{type(error).__name__}: {error}"
