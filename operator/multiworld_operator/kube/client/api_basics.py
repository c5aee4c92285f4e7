"""The operator's basics of talking to the Kubernetes API: the request timeout, the merge patch
content type, Event bodies, the retry backoff and the text of an API error (read by its
attributes: no kubernetes import, so the test harness and benches use it as they are).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from multiworld.contract import event_name

REQUEST_TIMEOUT_S = 30.0
MERGE_PATCH = "application/merge-patch+json"
# Kubernetes caps an Event's message at 1 KiB.
EVENT_MESSAGE_MAX = 1024


def event_body(
    involved: dict[str, str | None], type_: str, reason: str, message: str, component: str
) -> dict[str, Any]:
    """A core/v1 Event about `involved` (its apiVersion, kind, name, namespace and uid), posted by
    `component`; named after the object (multiworld.contract.event_name), in its namespace."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name(str(involved["name"])), "namespace": involved["namespace"]},
        "involvedObject": involved,
        "type": type_,
        "reason": reason,
        "message": message[:EVENT_MESSAGE_MAX],
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class Backoff:
    """Delays between retries: `first`, doubling up to `most`; `reset` after a success."""

    def __init__(self, first: float, most: float) -> None:
        self.first = first
        self.most = most
        self.delay = first

    def next(self) -> float:
        delay, self.delay = self.delay, min(self.most, self.delay * 2)
        return delay

    def reset(self) -> None:
        self.delay = self.first


def api_message(error: Any) -> str:
    """An ApiException (kubernetes.client.rest) in words: its status and the API's own
    explanation (the Status message of its body), else the HTTP reason."""
    try:
        message = json.loads(error.body or "")["message"]  # no body: no message
    except (TypeError, ValueError, KeyError):
        message = error.reason
    return f"{error.status} {message}"
