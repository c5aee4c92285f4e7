"""The MultiWorld resource's identity: its API group, version, kind and names, as the CRD
declares them and the operator's API calls, owner references and commands use them."""

from __future__ import annotations

API_GROUP = "multiworld.io"
API_VERSION = "v1alpha1"
GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"
KIND = "MultiWorld"
PLURAL = "multiworlds"
SINGULAR = "multiworld"
SHORT_NAMES = ["mw"]
