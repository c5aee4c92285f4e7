"""One MultiWorld's headless Service (DNS for its pods) and NetworkPolicy (bodies.py holds the
bodies), made to exist as its spec wants: the Service until it is seen deleted, the policy once
per spec generation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..spec import MultiWorld
from .api import KubeApi
from .bodies import declared_ports, network_policy_body, service_body
from .errors import not_ours


class Networking:
    def __init__(self, api: KubeApi, namespace: str, name: str, uid: str) -> None:
        self.api = api
        self.namespace, self.name, self.uid = namespace, name, uid
        self._service_known = False
        # The spec generation whose NetworkPolicy was last made to match (None: not yet).
        self._policy_checked: int | None = None

    def service_deleted(self) -> None:
        """The Service went: the next ensure_service creates it again."""
        self._service_known = False

    async def ensure_service(self, body: Mapping[str, Any]) -> str | None:
        """Create the Service unless it is known to exist; why it cannot be ours, if its name is
        taken (asked again next time)."""
        if self._service_known:
            return None
        if not await self.api.create_service(self.namespace, service_body(body)):
            taken = not_ours("Service", self.name, await self.api.read_service(self.namespace, self.name), self.uid)
            if taken:
                return taken
        self._service_known = True
        return None

    async def ensure_network_policy(self, body: Mapping[str, Any], multiworld: MultiWorld) -> str | None:
        """The MultiWorld's NetworkPolicy exists while spec.networkPolicy is on, and ours is gone
        when it is off. Checked once per spec generation; why it cannot be ours, if its name is
        taken (checked again next time)."""
        generation = body["metadata"].get("generation")
        if self._policy_checked == generation:
            return None
        if multiworld.spec.network_policy:
            templates = [multiworld.template_of(m.name) for m in multiworld.spec.members]
            policy = network_policy_body(body, declared_ports(templates))
            if not await self.api.create_network_policy(self.namespace, policy):
                found = await self.api.read_network_policy(self.namespace, self.name)
                taken = not_ours("NetworkPolicy", self.name, found, self.uid)
                if taken:
                    return taken
                if found is not None and found["spec"] != policy["spec"]:  # the declared ports changed
                    await self.api.patch_network_policy(self.namespace, self.name, {"spec": policy["spec"]})
        else:
            found = await self.api.read_network_policy(self.namespace, self.name)
            if found is not None and not not_ours("NetworkPolicy", self.name, found, self.uid):
                await self.api.delete_network_policy(self.namespace, self.name, found["metadata"]["uid"])
        self._policy_checked = generation
        return None
