"""What a surface that anything may reach (the operator's channel, webhook and metrics; a world's
store) keeps per source: its warnings, said once a minute per kind and source (`QuietLog`), and
token-bucket budgets (`Budgets`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

# A warning (a refusal, a silent or junk connection) is said once per kind and source this
# often, with a count of the ones held back; sources remembered at most.
LOG_EVERY_S = 60.0
MAX_LOG_KEYS = 4096
# Budgets are kept while they are not full again: looked over for full ones when they grow past
# this, or twice what the last look kept.
PRUNE_BUDGETS_FROM = 1024


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


class Budgets:
    """A token bucket per key (a pod, a source address), kept across its connections: `burst`
    at once, refilled at `rate` a second. A bucket full again is forgotten (a new one is the
    same), so those kept are of keys that spent within the last burst / rate seconds."""

    def __init__(self, burst: float, rate: float) -> None:
        self.burst, self.rate = burst, rate
        # Key -> (tokens, when they were counted).
        self._buckets: dict[Hashable, tuple[float, float]] = {}
        self._prune_at = PRUNE_BUDGETS_FROM

    def take(self, key: Hashable, amount: float = 1.0) -> bool:
        """Spend `amount` of `key`'s budget; False (nothing spent) when it holds less."""
        now = time.monotonic()
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        taken = tokens >= amount
        self._buckets[key] = (tokens - amount if taken else tokens, now)
        if len(self._buckets) > self._prune_at:
            self._buckets = {
                k: (t, at) for k, (t, at) in self._buckets.items() if t + (now - at) * self.rate < self.burst
            }
            self._prune_at = max(PRUNE_BUDGETS_FROM, 2 * len(self._buckets))
        return taken
