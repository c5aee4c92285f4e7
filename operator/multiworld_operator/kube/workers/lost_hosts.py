"""Pod instances lost with their hosts (pure): the worker channel heard nothing from a pod's worker,
not even the kernel's acknowledgement of a probe (channel_server.py: for LOST_AFTER_S, or for
ANSWER_WITHIN_S after the line a replaced instance's connection is sent), so its node is powered
off or cut off the network. Kubernetes says so only after the node monitor's
grace period (about 40 s: the Node NotReady) and evicts its pods 300 s later (the default
toleration), an eviction that never completes while the node is away.

- Such an instance has ended: the planner sees it Failed (observe.py), saying which node was lost
  and when, so every world it holds a rank in fails now and it is replaced, deleted at once (the
  API forgets it and its name is free for the replacement at once; its process, if it still
  runs, is fenced: epochs, the store's secret, its token bound to the deleted pod). The Node's
  condition and the eviction remain the backstop for a pod whose worker never connected.
- Its node is lost: every other instance of the MultiWorld on it has ended too (one whose
  connection has not timed out yet, a replacement placed there before the loss was known, which
  never starts). An instance already replaced still names its node: its peers most often name
  it half a second after the silence began, before its connection times out (the channel probes
  a replaced instance's connection on, and has its host answer within ANSWER_WITHIN_S:
  channel_server.py), so its node is remembered (`replaced`).
- For AVOID_S after, the MultiWorld's new pods are kept off that node (a required node affinity
  on its name): until Kubernetes taints it unreachable, the node looks Ready and, its pods
  deleted, empty: the scheduler's first choice. A pod made in that window keeps the rule for its
  life (see docs/resource.md).
- Each node lost is said once (`take_news`: the MultiWorld's Event).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

# How long a lost node is kept out of new pods' placement: past the node monitor's grace period
# (40 s) and the taint that follows it, with room for a loaded control plane.
AVOID_S = 120.0
# Replaced instances whose node is remembered (their connections are probed for seconds only).
MAX_REPLACED = 1024
# The Event that says a node was lost.
NODE_LOST = "NodeLost"


@dataclass(frozen=True)
class LostInstance:
    pod: str
    node: str
    at: datetime

    @property
    def reason(self) -> str:
        """Why the planner sees it Failed."""
        return _reason(self.node, self.at, "its worker's connection")


def _reason(node: str, at: datetime, heard: str) -> str:
    where = f"node {node}" if node else "its node"
    return (
        f"lost with {where} at {at:%Y-%m-%dT%H:%M:%SZ}: {heard} went unacknowledged "
        "(powered off or cut off the network)"
    )


class LostHosts:
    """The instances of one MultiWorld lost with their hosts, and the nodes they were lost on."""

    def __init__(self) -> None:
        # Pod uid -> how it was lost.
        self._instances: dict[str, LostInstance] = {}
        # Node -> when a pod was last lost with it.
        self._nodes: dict[str, datetime] = {}
        # Pod uid -> the node of an instance replaced lately (the most recent MAX_REPLACED).
        self._replaced: dict[str, str] = {}
        # Node -> when an instance there was last replaced for its silence.
        self._suspected: dict[str, datetime] = {}
        # Nodes newly lost, not said yet: (node, when, pod).
        self._news: list[LostInstance] = []

    def replaced(self, uid: str, node: str, at: datetime, *, silent: bool = False) -> None:
        """That instance, on `node`, is being replaced: its connection may still time out.
        `silent`: for its silence (a peer named it, or it did not join in time), so its node is
        suspected (see `suspected`)."""
        if node:
            if silent:
                self._suspected[node] = at
            self._replaced.pop(uid, None)
            self._replaced[uid] = node
            while len(self._replaced) > MAX_REPLACED:
                del self._replaced[next(iter(self._replaced))]

    def lost(self, uid: str, pod: str, node: str, at: datetime) -> bool:
        """That instance's host stopped answering (`node`: where it runs, "" when unknown: then
        where it ran, if it was replaced lately); whether it is news."""
        if uid in self._instances:
            return False
        node = node or self._replaced.get(uid, "")
        self._instances[uid] = LostInstance(pod, node, at)
        if node:
            if node not in self._nodes:
                self._news.append(LostInstance(pod, node, at))
            self._nodes[node] = max(at, self._nodes.get(node, at))
        return True

    def reasons(self, placed: Mapping[str, str]) -> dict[str, str]:
        """Pod uid -> why it is lost, for the instances `placed` (those still there: uid -> their
        node, "" until scheduled): those heard lost, and those on a node lost lately (see
        `avoid`); the rest is forgotten."""
        self._instances = {uid: lost for uid, lost in self._instances.items() if uid in placed}
        why = {uid: lost.reason for uid, lost in self._instances.items()}
        for uid, node in placed.items():
            at = self._nodes.get(node) if node else None
            if uid not in why and at is not None:
                why[uid] = _reason(node, at, "a worker's connection there")
        return why

    def lost_at(self, now: datetime) -> dict[str, datetime]:
        """The nodes lost within AVOID_S, and when each was last."""
        since = now - timedelta(seconds=AVOID_S)
        self._nodes = {node: at for node, at in self._nodes.items() if at > since}
        return dict(self._nodes)

    def avoid(self, now: datetime) -> list[str]:
        """The nodes new pods stay off now: those lost within AVOID_S."""
        return sorted(self.lost_at(now))

    def suspected(self, now: datetime) -> list[str]:
        """The nodes new pods rather go elsewhere than now (a preference, not a rule: the silent
        process may be frozen on a healthy node, and a cluster of one node has nowhere else):
        those where an instance was replaced for its silence within AVOID_S, and not lost."""
        since = now - timedelta(seconds=AVOID_S)
        self._suspected = {node: at for node, at in self._suspected.items() if at > since}
        return sorted(set(self._suspected) - set(self.avoid(now)))

    def take_news(self) -> list[str]:
        """What to say of each node newly lost, once."""
        news, self._news = self._news, []
        return [
            f"node {lost.node} lost at {lost.at:%Y-%m-%dT%H:%M:%SZ}: the connection of pod {lost.pod}'s worker "
            f"there went unacknowledged; every pod there is replaced on another node, and new pods are kept off "
            f"it for {AVOID_S:.0f} s"
            for lost in news
        ]
