"""Which pod is at the other end of a worker channel connection: its hello's token, checked with
a TokenReview (once per connection), must be a pod-bound ServiceAccount token of our audience
(multiworld.contract.TOKEN_AUDIENCE) whose pod is the one the hello names, and that pod (by uid)
must be one this operator made for a MultiWorld it serves. A worker therefore speaks only for
its own pod, whatever its code does; what it may say is checked per message by the reconciler.

A TokenReview is a request to the API server on the operator's shared thread pool, asked for
by anything that can connect: each source address may say HELLO_BURST hellos with a token at
once and HELLOS_PER_S a second after (past it: refused unchecked), and at most MAX_REVIEWS are
under way at once. The others wait their turn, within the channel's hello deadline, a source at a
time (`_Turns`): a new pod's hello waits for one review of each source waiting, not for every
hello a flood of junk tokens from many sources queued before it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Hashable

from kubernetes.client.rest import ApiException

from multiworld.contract import TOKEN_AUDIENCE, TOKEN_PATH, Hello
from multiworld.per_source import Budgets
from multiworld_operator.channel_server import HELLO_BURST, HELLOS_PER_S, Refused, Speaker
from multiworld_operator.kube.client.api import KubeApi
from multiworld_operator.kube.client.api_basics import api_message

log = logging.getLogger(__name__)

POD_NAME_CLAIM = "authentication.kubernetes.io/pod-name"
POD_UID_CLAIM = "authentication.kubernetes.io/pod-uid"
SERVICEACCOUNT_PREFIX = "system:serviceaccount:"
# TokenReviews under way at once (the API calls share a pool of 16 threads: most stay for the steps).
MAX_REVIEWS = 4

# (namespace, pod, uid) -> the MultiWorld that pod is of (None: no MultiWorld this operator serves).
Locate = Callable[[str, str, str], Hashable | None]


class _Turns:
    """At most `limit` holders at once; those waiting are let in a source at a time, in turn (the
    source let in goes to the back of the line), so a source's wait grows with how many sources
    wait, not with how many hellos they queued."""

    def __init__(self, limit: int) -> None:
        self._limit, self._holding = limit, 0
        # Per source, its waiters in arrival order; sources in the order of their turns.
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}

    @contextlib.asynccontextmanager
    async def turn(self, source: str) -> AsyncIterator[None]:
        if self._holding < self._limit and not self._waiting:
            self._holding += 1
        else:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(source, collections.deque()).append(future)
            try:
                await future
            except asyncio.CancelledError:
                if future.cancelled():
                    self._forget(source, future)
                else:  # let in as it was cancelled: the turn goes to the next
                    self._release()
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        self._holding -= 1
        while self._waiting and self._holding < self._limit:
            source = next(iter(self._waiting))
            queue = self._waiting.pop(source)
            future = queue.popleft()
            if queue:
                self._waiting[source] = queue
            if future.cancelled():  # its hello's deadline passed as it waited
                continue
            future.set_result(None)
            self._holding += 1

    def _forget(self, source: str, future: asyncio.Future[None]) -> None:
        queue = self._waiting.get(source)
        if queue is not None and future in queue:
            queue.remove(future)
            if not queue:
                del self._waiting[source]


class PodIdentities:
    def __init__(self, api: KubeApi, locate: Locate) -> None:
        self.api = api
        self.locate = locate
        self._hellos = Budgets(HELLO_BURST, HELLOS_PER_S)
        self._reviews = _Turns(MAX_REVIEWS)

    async def authenticate(self, hello: Hello, source: str) -> Speaker:
        if not hello.token:
            raise Refused(
                f"pod {hello.pod} sent no token: the operator mounts one in every pod it makes ({TOKEN_PATH})"
            )
        if not self._hellos.take(source):
            raise Refused(
                f"{source} said more than {HELLO_BURST} hellos at once or {HELLOS_PER_S:g} a second after; "
                "its token is not checked"
            )
        try:
            async with self._reviews.turn(source):
                review = await self.api.review_token(hello.token, TOKEN_AUDIENCE)
        except ApiException as error:
            # The operator's own problem (its RBAC, the API server): said in its log too.
            log.warning("TokenReview failed: %s", api_message(error))
            raise Refused(f"the operator could not check the token: {api_message(error)}") from error
        if not review.get("authenticated"):
            raise Refused(f"the token of pod {hello.pod} was not accepted: {review.get('error') or 'no reason given'}")
        user = review.get("user") or {}
        extra = user.get("extra") or {}
        pod = _claim(extra, POD_NAME_CLAIM)
        uid = _claim(extra, POD_UID_CLAIM)
        username = str(user.get("username", ""))
        namespace = username.removeprefix(SERVICEACCOUNT_PREFIX).partition(":")[0]
        if not pod or not uid or not username.startswith(SERVICEACCOUNT_PREFIX):
            raise Refused(f"the token of pod {hello.pod} is not bound to a pod (a projected ServiceAccount token is)")
        if pod != hello.pod:
            raise Refused(f"the hello names pod {hello.pod}, the token is pod {pod}'s")
        group = self.locate(namespace, pod, uid)
        if group is None:
            raise Refused(f"pod {namespace}/{pod} (uid {uid}) is no pod of a MultiWorld this operator serves")
        return Speaker(group, pod, uid)


def _claim(extra: dict[str, list[str]], key: str) -> str:
    values = extra.get(key) or []
    return str(values[0]) if values else ""
