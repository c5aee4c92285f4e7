"""One MultiWorld's headless Service (DNS for its pods) and NetworkPolicy (bodies.py holds the
bodies), made to exist as its spec wants: the Service until it is seen deleted, the policy once
per spec generation and again whenever the watch shows it deleted or edited by anyone else."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multiworld_operator.kube.client.api import KubeApi
from multiworld_operator.kube.objects.bodies import declared_ports, network_policy_body, service_body
from multiworld_operator.kube.objects.observe import ObjectMeta
from multiworld_operator.kube.reporting.errors import not_ours
from multiworld_operator.spec import MultiWorld


class Networking:
    def __init__(self, api: KubeApi, namespace: str, name: str, uid: str) -> None:
        self.api = api
        self.namespace, self.name, self.uid = namespace, name, uid
        self._service_known = False
        # The spec generation whose NetworkPolicy was last made to match (None: not yet), and
        # the policy's spec as made then (None: none wanted).
        self._policy_checked: int | None = None
        self._policy_spec: dict[str, Any] | None = None

    def service_deleted(self, service: Mapping[str, Any]) -> bool:
        """A Service labelled for this MultiWorld went; True when it was ours (the next
        ensure_service creates it again). Anyone who may write Services may label them: another
        one's deletion costs nothing."""
        meta = ObjectMeta.model_validate(service["metadata"])
        if meta.name != self.name or not meta.owned_by(self.uid):
            return False
        self._service_known = False
        return True

    def policy_changed(self, deleted: bool, policy: Mapping[str, Any]) -> bool:
        """Our NetworkPolicy as the watch reported it; True when it is no longer as made (the
        next ensure_network_policy makes it so again)."""
        if not ObjectMeta.model_validate(policy["metadata"]).owned_by(self.uid) or self._policy_spec is None:
            return False
        if not deleted and policy.get("spec") == self._policy_spec:
            return False  # our own write coming back
        self._policy_checked = None
        return True

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
                if found is not None and found["spec"] != policy["spec"]:  # the declared ports changed, or edited
                    await self.api.patch_network_policy(self.namespace, self.name, {"spec": policy["spec"]})
            self._policy_spec = policy["spec"]
        else:
            self._policy_spec = None
            found = await self.api.read_network_policy(self.namespace, self.name)
            if found is not None and not not_ours("NetworkPolicy", self.name, found, self.uid):
                await self.api.delete_network_policy(self.namespace, self.name, found["metadata"]["uid"])
        self._policy_checked = generation
        return None
