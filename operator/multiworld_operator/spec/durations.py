"""Durations as the spec writes them: `30s`, `5m`, `1h30m`, `500ms`, `2d`."""

from __future__ import annotations

import re

from multiworld_operator.spec.limits import MAX_DURATION, MAX_DURATION_LENGTH

DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h|d))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration like `30s`, `5m`, `1h`, `1h30m`, `500ms`, `2d` (`0s` allowed)."""
    if not isinstance(text, str) or not DURATION.match(text):
        raise ValueError(f"{text!r} is not a duration like 30s, 5m, 1h or 1h30m")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(text))


def check_duration(value: str) -> str:
    """`value` when it is a duration no longer than MAX_DURATION, else ValueError."""
    if len(value) > MAX_DURATION_LENGTH or parse_duration(value) > parse_duration(MAX_DURATION):
        raise ValueError(f"{value!r} is longer than the maximum duration, {MAX_DURATION}")
    return value
