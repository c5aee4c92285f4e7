"""Warnings of a surface that anything may reach (the operator's channel, webhook and metrics; a
world's store), rate-limited per kind and source."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

# A warning (a refusal, a silent or junk connection) is said once per kind and source this
# often, with a count of the ones held back; sources remembered at most.
LOG_EVERY_S = 60.0
MAX_LOG_KEYS = 4096


class QuietLog:
    """Warnings of a surface (`what`: the channel, the metrics), each kind from each source said
    once per LOG_EVERY_S with a count of those held back: anything in the cluster may connect, as
    often as it likes."""

    def __init__(self, what: str, logger: logging.Logger) -> None:
        self._what, self._log = what, logger
        self._said: dict[Hashable, tuple[float, int]] = {}

    def warn(self, key: Hashable, message: str, *args: object) -> None:
        now = time.monotonic()
        said = self._said.get(key)
        if said is not None and now - said[0] < LOG_EVERY_S:
            self._said[key] = (said[0], said[1] + 1)
            return
        if len(self._said) >= MAX_LOG_KEYS:
            self._said.clear()
        self._said[key] = (now, 0)
        held = f" ({said[1]} more like it in the last {now - said[0]:.0f} s)" if said is not None and said[1] else ""
        self._log.warning(self._what + ": " + message + "%s", *args, held)
