"""What a reconcile step fails with, and how a failure reads (pure).

`MultiWorldGone` ends the MultiWorld's loop; `CreateRefused` and any other error are retried
with a backoff (controller.py), and `step_failure` says what the status condition and the Event
of a failed step say. `not_ours` names an object that holds a name this MultiWorld needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multiworld.kube_api import EVENT_MESSAGE_MAX

from .observe import ObjectMeta
from .refusal import CREATE_REFUSED, RECONCILE_ERROR


class MultiWorldGone(Exception):
    """The MultiWorld was deleted while a step ran."""


class CreateRefused(Exception):
    """The API refused some creates (a pod, the Service), or their names are taken by objects
    that are not this MultiWorld's; the step is retried after a backoff."""


def step_failure(error: Exception) -> tuple[str, str]:
    """The reason and the message (cut to an Event's length) of a step that failed with `error`."""
    if isinstance(error, CreateRefused):
        reason, message = CREATE_REFUSED, str(error)
    else:
        reason, message = RECONCILE_ERROR, f"reconcile step failed: {type(error).__name__}: {error}"
    return reason, message[:EVENT_MESSAGE_MAX]


def not_ours(kind: str, name: str, found: Mapping[str, Any] | None, owner_uid: str) -> str | None:
    """Why `name` cannot be ours: an object of that name that the MultiWorld with uid
    `owner_uid` does not own (left alone, and named with its owner); None when it is ours, or
    gone meanwhile."""
    if found is None:
        return None
    meta = ObjectMeta.model_validate(found["metadata"])
    if meta.owned_by(owner_uid):
        return None
    owner = meta.controller
    return (
        f"{kind} {name} already exists and is not this MultiWorld's "
        f"({f'owned by {owner.kind} {owner.name}' if owner else 'it has no owner'}); it is left alone"
    )
