"""What a reconcile step fails with, and how a failure reads (pure).

`MultiWorldGone` ends the MultiWorld's loop; `CreateRefused`, `StepFailed` (an API call of the
step failed: `failing_as` names what the step was doing) and any other error are retried with a
backoff (controller.py), and `step_failure` says what the status condition and the Event of a
failed step say. `not_ours` names an object that holds a name this MultiWorld needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kubernetes.client.rest import ApiException

from multiworld_operator.kube.client.api_basics import EVENT_MESSAGE_MAX, api_message
from multiworld_operator.kube.objects.observe import ObjectMeta
from multiworld_operator.kube.reporting.refusal import API_ERROR, CONFLICT, CREATE_REFUSED, RECONCILE_ERROR


class MultiWorldGone(Exception):
    """The MultiWorld was deleted while a step ran."""


class CreateRefused(Exception):
    """The API refused some creates (a pod, the Service), or their names are taken by objects
    that are not this MultiWorld's; the step is retried after a backoff."""


class StepFailed(Exception):
    """An API call of a reconcile step failed (the message says which, and the API's answer);
    the step ends there and is retried with a backoff."""

    def __init__(self, message: str, *, conflict: bool = False) -> None:
        super().__init__(message)
        # A 409: an object was written meanwhile by someone else (or created under our name),
        # so what this operator knows of it is stale: read it again before planning again.
        self.conflict = conflict


@contextmanager
def failing_as(what: str) -> Iterator[None]:
    """An API error (or a connection's) inside is a StepFailed that says `what` failed."""
    try:
        yield
    except ApiException as error:
        raise StepFailed(f"{what}: {api_message(error)}", conflict=error.status == 409) from error
    except OSError as error:
        raise StepFailed(f"{what}: {type(error).__name__}: {error}") from error


def step_failure(error: Exception) -> tuple[str, str]:
    """The reason and the message (cut to an Event's length) of a step that failed with `error`."""
    if isinstance(error, CreateRefused):
        reason, message = CREATE_REFUSED, str(error)
    elif isinstance(error, StepFailed):
        reason, message = CONFLICT if error.conflict else API_ERROR, f"reconcile step failed: {error}"
    elif isinstance(error, ApiException):
        reason, message = API_ERROR, f"reconcile step failed: {api_message(error)}"
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
