"""The status subresource of one MultiWorld: the planner's view (what kubectl shows), the
refusal of an invalid spec, the condition of a failed step; each written only where it
differs from what was last written or watched."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.rest import ApiException

from multiworld_operator.kube.client.api import KubeApi
from multiworld_operator.kube.reporting.errors import MultiWorldGone
from multiworld_operator.kube.reporting.refusal import error_patch, refusal_patch
from multiworld_operator.planner import MultiWorldStatus, merge_patch

log = logging.getLogger(__name__)


class StatusWriter:
    def __init__(self, api: KubeApi, namespace: str, name: str, view: dict[str, Any] | None) -> None:
        self.api = api
        self.namespace, self.name = namespace, name
        # The CR's status as last written or watched.
        self.view = view

    async def show(self, status: MultiWorldStatus) -> None:
        view = status.view()
        if view != self.view:
            await self._patch(merge_patch(self.view, view), view)

    async def show_refusal(self, generation: int | None, problems: list[str]) -> str | None:
        """Say that the spec is invalid, unless the status says so already; the message, if it
        was said now."""
        patch = refusal_patch(self.view, generation, problems, datetime.now(UTC))
        if patch is None:
            return None
        log.warning("%s", "; ".join(problems))
        await self._patch(patch, {**(self.view or {}), **patch})
        message: str = patch["conditions"][-1]["message"]
        return message

    async def show_error(self, reason: str, message: str) -> None:
        """Say that a step failed, unless the status says so already."""
        patch = error_patch(self.view, reason, message, datetime.now(UTC))
        if patch is not None:
            await self._patch(patch, {**(self.view or {}), **patch})

    async def _patch(self, patch: dict[str, Any], desired: dict[str, Any]) -> None:
        try:
            await self.api.patch_status(self.namespace, self.name, patch)
        except ApiException as error:
            if error.status == 404:
                raise MultiWorldGone(f"{self.namespace}/{self.name}") from error
            raise
        self.view = desired
