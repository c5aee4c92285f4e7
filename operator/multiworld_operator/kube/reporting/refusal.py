"""The status of a MultiWorld whose spec is invalid, or whose reconcile step failed (pure).

The CRD schema refuses wrong types; cross-field problems (an undeclared member, a world of one
rank, a pod name too long, ...) only the controller sees. Such a spec creates nothing: a
MultiWorld that never had a valid spec is Failed; one that had keeps its pods and status as
they were. Either way the condition `SpecValid` says what is wrong, naming each field.

A failed reconcile step (retried with a backoff) shows as the condition `Reconciled` False:
reason CreateRefused when the API refused a create or the name is taken by an object that is
not this MultiWorld's, ApiError when another API call failed (a ConfigMap quota, an object over
the API server's size limit, a timeout: the message says which write), Conflict when an object
of this MultiWorld was written meanwhile by someone else (it is read again and the next step
plans from it), ReconcileError for an unexpected error; the next successful step's status drops
it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from multiworld_operator.planner import Condition, MultiWorldStatus

SPEC_VALID = "SpecValid"
INVALID_SPEC = "InvalidSpec"
RECONCILED = "Reconciled"
RECONCILE_ERROR = "ReconcileError"
CREATE_REFUSED = "CreateRefused"
API_ERROR = "ApiError"
CONFLICT = "Conflict"


def refusal_patch(
    stored: Mapping[str, Any] | None, generation: int | None, problems: list[str], now: datetime
) -> dict[str, Any] | None:
    """The status fields to set for an invalid spec (a merge patch that only sets), or None
    when `stored` already says so for this generation."""
    message = refusal_message(problems)
    stored = stored or {}
    old = _condition(stored, SPEC_VALID)
    if old is not None and old.get("message") == message and stored.get("observedGeneration") == generation:
        return None
    refusal = Condition(type=SPEC_VALID, status="False", reason=INVALID_SPEC, message=message, last_transition_time=now)
    previous = MultiWorldStatus.from_dict(stored)
    if previous is None:
        ready = refusal.model_copy(update={"type": "Ready"})
        return {
            "phase": "Failed",
            "observedGeneration": generation,
            "worldsReady": "0/0",
            "restarts": 0,
            "conditions": [_dump(ready), _dump(refusal)],
        }
    kept = [_dump(c) for c in previous.conditions if c.type != SPEC_VALID]
    return {"observedGeneration": generation, "conditions": [*kept, _dump(refusal)]}


def refusal_message(problems: list[str]) -> str:
    """What SpecValid and the admission webhook say of an invalid spec: every problem, each
    naming its field (spec.parse_manifest's SpecError.problems)."""
    return "invalid spec: " + "; ".join(problems)


def error_patch(stored: Mapping[str, Any] | None, reason: str, message: str, now: datetime) -> dict[str, Any] | None:
    """The conditions to set after a reconcile step failed for `reason` with `message` (every
    other condition kept), or None when `stored` already says so."""
    stored = stored or {}
    old = _condition(stored, RECONCILED)
    if old is not None and old.get("message") == message:
        return None
    error = Condition(type=RECONCILED, status="False", reason=reason, message=message, last_transition_time=now)
    kept = [c for c in stored.get("conditions") or [] if c.get("type") != RECONCILED]
    return {"conditions": [*kept, _dump(error)]}


def _condition(stored: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in stored.get("conditions") or [] if c.get("type") == type_), None)


def _dump(condition: Condition) -> dict[str, Any]:
    return condition.model_dump(mode="json", by_alias=True)
