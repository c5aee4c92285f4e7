"""Which pod is at the other end of a worker channel connection: its hello's token, checked with
a TokenReview (once per connection), must be a pod-bound ServiceAccount token of our audience
(multiworld.contract.TOKEN_AUDIENCE) whose pod is the one the hello names, and that pod (by uid)
must be one this operator made for a MultiWorld it serves. A worker therefore speaks only for
its own pod, whatever its code does; what it may say is checked per message by the reconciler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

from kubernetes.client.rest import ApiException

from multiworld.contract import TOKEN_AUDIENCE, TOKEN_PATH, Hello

from ..channel_server import Refused, Speaker
from .api import KubeApi
from .api_basics import api_message

log = logging.getLogger(__name__)

POD_NAME_CLAIM = "authentication.kubernetes.io/pod-name"
POD_UID_CLAIM = "authentication.kubernetes.io/pod-uid"
SERVICEACCOUNT_PREFIX = "system:serviceaccount:"

# (namespace, pod, uid) -> the MultiWorld that pod is of (None: no MultiWorld this operator serves).
Locate = Callable[[str, str, str], Hashable | None]


class PodIdentities:
    def __init__(self, api: KubeApi, locate: Locate) -> None:
        self.api = api
        self.locate = locate

    async def authenticate(self, hello: Hello) -> Speaker:
        if not hello.token:
            raise Refused(
                f"pod {hello.pod} sent no token: the operator mounts one in every pod it makes ({TOKEN_PATH})"
            )
        try:
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
