"""What the operator writes: pod and Service bodies, their labels and annotations (pure).

Pods are `<mw>-<member>-<ordinal>` with hostname `<pod>` and subdomain `<mw>`, so the headless
Service `<mw>` makes `<pod>.<mw>` resolve inside the namespace even before the pod is ready.
A warm spare `<mw>-<member>-spare-<serial>` is labelled `multiworld.io/spare`; once it plays a
member pod it is labelled `multiworld.io/plays` and `multiworld.io/ordinal` too (its hostname
stays its own name: rendezvous goes through the table, which names the spare).
"""

from __future__ import annotations

import copy
import json
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from multiworld.contract import ENV_NAME, ENV_NAMESPACE, NAME_LABEL, TOKEN_AUDIENCE, TOKEN_PATH
from multiworld_operator.planner import CreatePod
from multiworld_operator.spec.resource import GROUP_VERSION, KIND

MEMBER_LABEL = "multiworld.io/member"
ORDINAL_LABEL = "multiworld.io/ordinal"
SPARE_LABEL = "multiworld.io/spare"
PLAYS_LABEL = "multiworld.io/plays"
# The planner's memory ConfigMap is labelled with its MultiWorld under a key of its own, not
# NAME_LABEL: `kubectl delete -l multiworld.io/name=<mw>` (its pods, say) cannot take the memory
# with it.
MEMORY_LABEL = "multiworld.io/memory-of"
# The planner's stamp on each pod instance (CreatePod.created_for), read back when observing.
CREATED_FOR_ANNOTATION = "multiworld.io/created-for"
COMPONENT = "multiworld-operator"


# The volume of the pod-bound token by which a worker proves its pod to the operator; the kubelet
# renews it well before it expires.
TOKEN_VOLUME = "multiworld-token"
TOKEN_LIFETIME_S = 3600


# torch's store client looks up the name of each address it connects to, as an IPv6 one: rank 0
# reaches its own stores over loopback, as ::ffff:127.0.0.1, which the kubelet's /etc/hosts does
# not list, so each of those connects waited on the cluster's DNS (and its upstream, where
# 127.in-addr.arpa lives) before this line of the pod's /etc/hosts answered it. A pod on the
# node's network keeps the node's file.
_LOOPBACK_ALIAS = {"ip": "::ffff:127.0.0.1", "hostnames": ["localhost"]}

_TOKEN_MOUNT = {"name": TOKEN_VOLUME, "mountPath": posixpath.dirname(TOKEN_PATH), "readOnly": True}
_TOKEN_SOURCE = {
    "name": TOKEN_VOLUME,
    "projected": {
        "sources": [
            {
                "serviceAccountToken": {
                    "audience": TOKEN_AUDIENCE,
                    "expirationSeconds": TOKEN_LIFETIME_S,
                    "path": posixpath.basename(TOKEN_PATH),
                }
            }
        ]
    },
}


def rendezvous_host(multiworld: str, rank0_pod: str) -> str:
    return f"{rank0_pod}.{multiworld}"


def selector(multiworld: str) -> str:
    return f"{NAME_LABEL}={multiworld}"


def owner_reference(multiworld: Mapping[str, Any]) -> dict[str, Any]:
    """Makes the MultiWorld own a pod or Service, so deleting it deletes them (garbage collector).
    No blockOwnerDeletion: that would need update on multiworlds/finalizers where the
    OwnerReferencesPermissionEnforcement admission plugin runs."""
    meta = multiworld["metadata"]
    return {"apiVersion": GROUP_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"], "controller": True}


def _quantities_as_strings(resources: dict[str, Any]) -> None:
    """`nvidia.com/gpu: 1` as the API stores it ("1"): the Kubernetes client (from 37) refuses
    a number where its model declares a quantity string, so a template written the usual way
    would never become a pod."""
    for kind in ("limits", "requests"):
        amounts = resources.get(kind)
        if isinstance(amounts, dict):
            for name, amount in amounts.items():
                if isinstance(amount, (int, float)) and not isinstance(amount, bool):
                    amounts[name] = str(amount)


def _affinity(spec: dict[str, Any], kind: str) -> dict[str, Any]:
    """The pod spec's affinity of `kind` (nodeAffinity, podAntiAffinity), to add terms to: made
    in `spec` where it has none, a copy of the template's where it has one."""
    affinity = spec["affinity"] = dict(spec.get("affinity") or {})
    of_kind: dict[str, Any] = dict(affinity.get(kind) or {})
    affinity[kind] = of_kind
    return of_kind


HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


def _keep_off(spec: dict[str, Any], nodes: Sequence[str]) -> None:
    """A required node affinity that rules out `nodes` (by name), added to each of the
    template's node selector terms (they are ORed: each must rule them out) or as the one term."""
    off = {"key": "metadata.name", "operator": "NotIn", "values": sorted(nodes)}
    node_affinity = _affinity(spec, "nodeAffinity")
    key = "requiredDuringSchedulingIgnoredDuringExecution"
    required = node_affinity[key] = dict(node_affinity.get(key) or {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [{**term, "matchFields": [*(term.get("matchFields") or []), off]} for term in terms]


def _rather_off(spec: dict[str, Any], nodes: Sequence[str], multiworld: str, member: str) -> None:
    """A preferred node affinity, as heavy as the API allows, for any node but `nodes`. Where the
    template sets no topology spread, the pod spreads over nodes with its member's pods only: the
    scheduler's default spread (over the pods of the MultiWorld's Service) would favour the node
    emptied by the loss, the very node this pod should rather not go to, over the affinity."""
    off = {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": sorted(nodes)}]}
    node_affinity = _affinity(spec, "nodeAffinity")
    key = "preferredDuringSchedulingIgnoredDuringExecution"
    node_affinity[key] = [*(node_affinity.get(key) or []), {"weight": 100, "preference": off}]
    if not spec.get("topologySpreadConstraints"):
        spec["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": HOSTNAME_TOPOLOGY,
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {NAME_LABEL: multiworld, MEMBER_LABEL: member}},
            }
        ]


# Where a warm spare rather goes: off the nodes of the pods it stands in for (a node lost takes
# them, not it), then off those of its member's other idle spares (spread). Preferences, so a
# cluster of one node still runs its spares; the scheduler weighs an existing pod's terms against
# a new pod too, so the order in which member pods and spares are scheduled does not matter.
SPARE_OFF_MEMBERS_WEIGHT = 100
SPARE_SPREAD_WEIGHT = 50


def _spare_placement(spec: dict[str, Any], multiworld: str, member: str) -> None:
    """A warm spare's preferred pod anti-affinity (see SPARE_OFF_MEMBERS_WEIGHT), added to the
    template's own."""
    ours = {NAME_LABEL: multiworld, MEMBER_LABEL: member}
    members = {"matchLabels": ours, "matchExpressions": [{"key": ORDINAL_LABEL, "operator": "Exists"}]}
    idle_spares = {
        "matchLabels": {**ours, SPARE_LABEL: "true"},
        "matchExpressions": [{"key": PLAYS_LABEL, "operator": "DoesNotExist"}],
    }
    anti = _affinity(spec, "podAntiAffinity")
    key = "preferredDuringSchedulingIgnoredDuringExecution"
    anti[key] = [
        *(anti.get(key) or []),
        *(
            {"weight": weight, "podAffinityTerm": {"labelSelector": selector, "topologyKey": HOSTNAME_TOPOLOGY}}
            for weight, selector in ((SPARE_OFF_MEMBERS_WEIGHT, members), (SPARE_SPREAD_WEIGHT, idle_spares))
        ),
    ]


def pod_body(
    action: CreatePod,
    multiworld: Mapping[str, Any],
    channel_url: str,
    *,
    avoid_nodes: Sequence[str] = (),
    prefer_off: Sequence[str] = (),
) -> dict[str, Any]:
    """The pod for `action`, from its member's template: our labels, the created-for stamp,
    the worker contract's environment in every container (its live table from the operator at
    `channel_url`) with the pod's token mounted, restartPolicy Never (the operator, not the
    kubelet, decides what a failure costs), kept off `avoid_nodes` (nodes just lost:
    lost_hosts.py) whatever else its template's node affinity says, and rather off `prefer_off`
    (nodes where an instance was replaced for its silence); a warm spare rather off the nodes of
    the pods it stands in for, and of its member's other spares."""
    meta = multiworld["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    template = copy.deepcopy(dict(action.template))
    template_meta = template.get("metadata") or {}
    spec = template.get("spec") or {}
    env = {
        **action.worker_env(channel_url).to_env(),
        ENV_NAME: name,
        ENV_NAMESPACE: namespace,
    }
    for container in spec.get("containers") or []:
        own = [e for e in container.get("env") or [] if e.get("name") not in env]
        container["env"] = own + [{"name": key, "value": value} for key, value in env.items()]
        # A worker that must stop says why in its last log lines when it could not write
        # /dev/termination-log; the operator quotes that message in the failure it reports.
        container.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
        mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != TOKEN_VOLUME]
        container["volumeMounts"] = [*mounts, dict(_TOKEN_MOUNT)]
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") != TOKEN_VOLUME]
    spec["volumes"] = [*volumes, copy.deepcopy(_TOKEN_SOURCE)]
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        _quantities_as_strings(container.get("resources") or {})
    spec.update(restartPolicy="Never", hostname=action.pod, subdomain=name)
    if not spec.get("hostNetwork"):
        spec["hostAliases"] = [*(spec.get("hostAliases") or []), dict(_LOOPBACK_ALIAS)]
    if avoid_nodes:
        _keep_off(spec, avoid_nodes)
    if prefer_off:
        _rather_off(spec, prefer_off, name, action.member)
    if action.spare:
        _spare_placement(spec, name, action.member)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": action.pod,
            "namespace": namespace,
            "labels": {
                **(template_meta.get("labels") or {}),
                NAME_LABEL: name,
                MEMBER_LABEL: action.member,
                **({SPARE_LABEL: "true"} if action.spare else {ORDINAL_LABEL: str(action.ordinal)}),
            },
            "annotations": {
                **(template_meta.get("annotations") or {}),
                CREATED_FOR_ANNOTATION: json.dumps(action.created_for, sort_keys=True, separators=(",", ":")),
            },
            "ownerReferences": [owner_reference(multiworld)],
        },
        "spec": spec,
    }


def plays_labels(pod: str, ordinal: int) -> dict[str, str]:
    """The labels a warm spare gets when it plays member pod `pod`."""
    return {PLAYS_LABEL: pod, ORDINAL_LABEL: str(ordinal)}


def network_policy_body(multiworld: Mapping[str, Any], declared_ports: list[dict[str, Any]]) -> dict[str, Any]:
    """The NetworkPolicy `<mw>`: the pods admit their own MultiWorld's pods on any port (rank 0's
    store, gloo and NCCL on ephemeral ports) and anyone on the container ports the templates
    declare (the user's own serving ports); nothing else reaches them where policies are
    enforced. Egress is not restricted."""
    meta = multiworld["metadata"]
    ours = {"matchLabels": {NAME_LABEL: meta["name"]}}
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": ours}]}]
    if declared_ports:
        ingress.append({"ports": declared_ports})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _named_after(multiworld),
        "spec": {"podSelector": ours, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def declared_ports(templates: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every container port the templates declare, as NetworkPolicy ports (deduplicated)."""
    found: list[dict[str, Any]] = []
    for template in templates:
        for container in (template.get("spec") or {}).get("containers") or []:
            for port in container.get("ports") or []:
                entry = {"port": port["containerPort"], "protocol": port.get("protocol", "TCP")}
                if entry not in found:
                    found.append(entry)
    return found


def _named_after(multiworld: Mapping[str, Any]) -> dict[str, Any]:
    """Metadata of an object named after its MultiWorld, labelled with it and owned by it."""
    meta = multiworld["metadata"]
    return {
        "name": meta["name"],
        "namespace": meta["namespace"],
        "labels": {NAME_LABEL: meta["name"]},
        "ownerReferences": [owner_reference(multiworld)],
    }


def service_body(multiworld: Mapping[str, Any]) -> dict[str, Any]:
    """The headless Service `<mw>`: DNS for every pod, ready or not (ranks rendezvous before
    any readiness probe could pass)."""
    meta = multiworld["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _named_after(multiworld),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {NAME_LABEL: meta["name"]},
        },
    }
