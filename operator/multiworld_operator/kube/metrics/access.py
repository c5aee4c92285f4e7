"""Who may read the operator's metrics, decided as controller-runtime's metrics filter
(filters.WithAuthenticationAndAuthorization) decides it: a request's bearer token is checked
with a TokenReview (whose is it; for the API server's own audiences, as a ServiceAccount token
mounted in Prometheus's pod is) and a SubjectAccessReview (may that user `get` the non-resource
URL /metrics: the chart's ClusterRole `<release>-metrics-reader` grants it to whoever it is bound
to). No token, or one the API server does not accept: 401; a user without that permission: 403.

Each answer is kept by the token's SHA-256 (never the token), an allowed one ALLOWED_FOR_S and a
refused one REFUSED_FOR_S (controller-runtime: a TokenReview 1 minute, a refusal 30 s), at most
MAX_REMEMBERED of them (the least recently used goes): Prometheus scraping every 15 s costs the
API server two requests a minute. A token not remembered costs two API requests on the
operator's behalf, and anything in the cluster can send one: a source address may ask for
CHECK_BURST checks at once and CHECKS_PER_S a second after (past it: 429, unchecked), at most
MAX_CHECKS run at once (in threads of their own, not the reconcile steps'), and requests with
the same token while its check runs wait for that one.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from dataclasses import dataclass

from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from multiworld.per_source import Budgets, QuietLog
from multiworld_operator.kube.client.api import KubeApi
from multiworld_operator.kube.client.api_basics import api_message

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
ALLOWED_FOR_S = 60.0
REFUSED_FOR_S = 30.0
MAX_REMEMBERED = 1024
MAX_CHECKS = 2
CHECK_BURST = 10
CHECKS_PER_S = 1.0


@dataclass(frozen=True)
class Verdict:
    """An HTTP status for a request (200: serve it) and why."""

    code: int
    reason: str


NO_TOKEN = Verdict(401, "no bearer token")


class MetricsAccess:
    """Checks bearer tokens for `get` on `path` against the API server `api` talks to."""

    def __init__(self, api: KubeApi, path: str = METRICS_PATH) -> None:
        self.api = api
        self.path = path
        # SHA-256 of a token -> (its verdict, when it expires), least recently used first.
        self._remembered: collections.OrderedDict[bytes, tuple[Verdict, float]] = collections.OrderedDict()
        self._checking: dict[bytes, asyncio.Task[Verdict]] = {}
        self._checks = Budgets(CHECK_BURST, CHECKS_PER_S)
        self._gate: asyncio.Semaphore | None = None
        self._warn = QuietLog("metrics", log).warn

    async def check(self, token: str, source: str) -> Verdict:
        """The verdict for a request from `source` (an address) bearing `token` ("" for none)."""
        if not token:
            return NO_TOKEN
        key = hashlib.sha256(token.encode()).digest()
        remembered = self._remembered.get(key)
        if remembered is not None:
            if remembered[1] > time.monotonic():
                self._remembered.move_to_end(key)
                return remembered[0]
            del self._remembered[key]
        running = self._checking.get(key)
        if running is None:
            if not self._checks.take(source):
                return Verdict(
                    429, f"{source} asked for more than {CHECK_BURST} token checks at once or {CHECKS_PER_S:g} a second"
                )
            running = asyncio.ensure_future(self._review(key, token))
            self._checking[key] = running
            running.add_done_callback(lambda _: self._checking.pop(key, None))
        return await asyncio.shield(running)

    async def _review(self, key: bytes, token: str) -> Verdict:
        if self._gate is None:  # made on the loop that serves the metrics
            self._gate = asyncio.Semaphore(MAX_CHECKS)
        async with self._gate:
            try:
                verdict = await self._ask(token)
            except (ApiException, HTTPError, OSError) as error:
                # The operator's problem (its RBAC, the API server): not remembered.
                reason = api_message(error) if isinstance(error, ApiException) else str(error)
                self._warn(("check",), "could not check a token: %s", reason)
                return Verdict(503, "the operator could not check the token")
        self._remembered[key] = (verdict, time.monotonic() + (ALLOWED_FOR_S if verdict.code == 200 else REFUSED_FOR_S))
        while len(self._remembered) > MAX_REMEMBERED:
            self._remembered.popitem(last=False)
        return verdict

    async def _ask(self, token: str) -> Verdict:
        review = await self.api.review_token(token, None)
        if not review.get("authenticated"):
            return Verdict(401, "the token was not accepted")
        user = review.get("user") or {}
        access = await self.api.review_access(user, "get", self.path)
        if not access.get("allowed"):
            return Verdict(403, f"{user.get('username', 'that user')} may not get {self.path}")
        return Verdict(200, "allowed")
