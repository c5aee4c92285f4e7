"""Writes one MultiWorld's ConfigMap (the planner's memory), replaced at the resourceVersion this
operator last wrote or read, so a write never needs a read first while nobody else touched the
ConfigMap, and never overwrites what someone else wrote meanwhile: the 409 ends the step, whose
reconciler reads the memory again before it plans again."""

from __future__ import annotations

from typing import Any

from multiworld_operator.kube.client.api import KubeApi


class ConfigMapWriter:
    def __init__(self, api: KubeApi, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        # ConfigMap name -> the resourceVersion last written or read.
        self._versions: dict[str, str] = {}

    def read_at(self, name: str, version: str) -> None:
        """The ConfigMap `name` was read at `version`."""
        self._versions[name] = version

    async def write(self, body: dict[str, Any]) -> bool:
        """Create or replace the ConfigMap; False when its name is taken by one not ours (left
        alone). An ApiException 409 when it was written (or created) meanwhile by someone else."""
        name = body["metadata"]["name"]
        version = await self.api.write_configmap(self.namespace, body, self._versions.get(name))
        if version is None:
            return False
        self._versions[name] = version
        return True
