"""What the test nodes share on the host: the node bridge, routes, cluster DNS, the scheduler.

The host end of every node's veth joins one bridge (`multiworld0`, 10.243.0.1/24); the host
routes each node's pod network via that node's address, and masquerades pod traffic that leaves
the machine. The control plane, dnsmasq (cluster DNS, fed by dns_records.py), kube-scheduler and
a kube-proxy of the host's own (the API server calls webhooks at their Service's ClusterIP)
run in the host's namespaces and serve every node on the host's address: nodes reach it through
their default route.

The nodes change the host (a bridge, namespaces, iptables rules, a few sysctls, mounts,
cgroups), so one set of nodes runs per machine, claimed by a marker file; `cleanup_host` undoes
every change, also after a crash.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.cluster.host import (
    NodeError,
    listening,
    read_sysctl,
    remove_cgroup,
    remove_rules,
    run,
    unmount_under,
    write_sysctl,
)
from tests.cluster.node import CLUSTER_CIDR, DOMAIN, GATEWAY, MAX_NODES, Node, NodeBinaries

# Marks the machine's nodes: which folders run them (so a second `up` is refused by name).
MARKER = Path("/run/multiworld-node.json")
RULE_COMMENT = "multiworld-node"
BRIDGE = "multiworld0"
LEGACY_BRIDGE = "cni0"  # where a node of the host's own namespace (before nodes had theirs) left it
# The host settings kubelet, kube-proxy and the pod network change; restored on cleanup.
SYSCTLS = (
    "vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.ipv4.ip_forward",
    "net.ipv4.conf.all.route_localnet",
)  # fmt: skip
# The host's daemons, in start order (the nodes' kubelets start between the proxy and the scheduler).
DAEMONS = ("dnsmasq", "dns-records", "kube-proxy-host", "kube-scheduler")


def host_ip() -> str:
    """The host's own address (the default route's source): pods reach the API server and DNS there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # no packet is sent: this only picks a route
        except OSError as error:
            raise NodeError(f"no default route to pick the control plane's address from: {error}") from error
        return str(probe.getsockname()[0])


def upstream_nameserver() -> str:
    """The host's first nameserver: dnsmasq forwards every name outside the cluster domain there."""
    for line in Path("/etc/resolv.conf").read_text().splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            return words[1]
    raise NodeError("/etc/resolv.conf names no nameserver for dnsmasq to forward to")


def query_a(server: str, name: str, timeout: float = 1.0) -> list[str]:
    """The IPv4 addresses a DNS server answers for `name` (one UDP query, as a pod's resolver)."""
    query_id = int.from_bytes(os.urandom(2), "big")
    question = b"".join(bytes([len(label)]) + label.encode() for label in name.rstrip(".").split(".")) + b"\0"
    packet = query_id.to_bytes(2, "big") + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + question + b"\x00\x01\x00\x01"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(packet, (server, 53))
        reply = sock.recv(4096)
    answers = int.from_bytes(reply[6:8], "big")
    offset = 12 + len(question) + 4
    found = []
    for _ in range(answers):
        while reply[offset] not in (0,) and reply[offset] < 0xC0:  # a name: labels, or a pointer
            offset += reply[offset] + 1
        offset += 2 if reply[offset] >= 0xC0 else 1
        kind, length = (
            int.from_bytes(reply[offset : offset + 2], "big"),
            int.from_bytes(reply[offset + 8 : offset + 10], "big"),
        )
        offset += 10
        if kind == 1 and length == 4:
            found.append(socket.inet_ntoa(reply[offset : offset + 4]))
        offset += length
    return found


def node_folder(directory: Path, index: int) -> Path:
    """Node `index`'s folder in a cluster's folder: node, node-2, node-3."""
    return directory / ("node" if index == 1 else f"node-{index}")


def nodes_in(directory: Path, host: str = "", count: int | None = None) -> list[Node]:
    """The cluster's nodes: `count` of them, or as many as their folders say."""
    if count is None:
        count = 0
        while count < MAX_NODES and node_folder(directory, count + 1).is_dir():
            count += 1
    return [Node(node_folder(directory, index), index, host) for index in range(1, count + 1)]


class NodeHost:
    """The host side of a cluster's `nodes`: its folder is `directory` (DNS records there)."""

    def __init__(self, directory: Path, nodes: list[Node], ip: str = "") -> None:
        self.directory = directory
        self.nodes = nodes
        self.ip = ip
        self.dns_dir = directory / "dns"

    # ---- start -------------------------------------------------------------------------------

    def claim_host(self) -> None:
        """Refuse when another folder's nodes run; clear what crashed ones left; save sysctls."""
        if MARKER.exists():
            owners = _marked_nodes(json.loads(MARKER.read_text()))
            ours = {node.directory for node in self.nodes}
            for owner in owners:
                if owner.directory not in ours and listening(owner.socket):
                    raise NodeError(
                        f"a node already runs on this machine from {owner.directory} (one set of nodes per "
                        f"machine: they own {BRIDGE} and the pod network); stop it first (`make cluster-down` "
                        "for .cluster/)"
                    )
            NodeHost(self.directory, owners).cleanup_host()
        self.cleanup_host()
        saved = {key: read_sysctl(key) for key in SYSCTLS}
        marked = [[str(node.directory), node.index] for node in self.nodes]
        MARKER.write_text(json.dumps({"directory": marked[0][0], "nodes": marked, "sysctls": saved}))
        write_sysctl("net.ipv4.ip_forward", "1")

    def plug(self) -> None:
        """The node bridge, every node's namespaces on it, the host's routes to the pod networks."""
        run(["ip", "link", "add", BRIDGE, "type", "bridge"], "making the node bridge")
        run(["ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE], "the node bridge's address")
        run(["ip", "link", "set", BRIDGE, "up"], "the node bridge up")
        tag = ["-m", "comment", "--comment", RULE_COMMENT]
        for direction in ("-i", "-o"):
            # dockerd with iptables sets FORWARD's policy to DROP, and bridged traffic between
            # nodes goes through FORWARD: accept the node bridge explicitly.
            run(["iptables", "-w", "-I", "FORWARD", direction, BRIDGE, *tag, "-j", "ACCEPT"], "allowing node traffic")
        run(["iptables", "-w", "-t", "nat", "-A", "POSTROUTING", "-s", CLUSTER_CIDR, "!", "-d", CLUSTER_CIDR,
             "!", "-o", BRIDGE, *tag, "-j", "MASQUERADE"], "masquerading pods leaving the machine")  # fmt: skip
        for node in self.nodes:
            node.make_namespaces(BRIDGE, self.nodes)
            run(["ip", "route", "add", node.pod_subnet, "via", node.ip], f"the host's route to {node.name}'s pods")
        self.dns_dir.mkdir(parents=True, exist_ok=True)
        (self.dns_dir / "hosts").write_text("")

    def commands(self, binaries: NodeBinaries, kubeconfig: Path) -> dict[str, list[str]]:
        """The host daemons' argv; kube-proxy, the scheduler and the DNS feed act as the admin."""
        return {
            "dnsmasq": [
                "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--user=root", "--pid-file=",
                f"--listen-address={self.ip}", "--bind-interfaces", "--no-hosts", "--no-resolv",
                f"--hostsdir={self.dns_dir}", f"--local=/{DOMAIN}/", "--no-negcache",
                # A reverse lookup of a private address it has no record of (a pod's, which
                # torch's store looks up as it connects) is answered NXDOMAIN here, not sent to
                # the machine's own nameserver: how fast that one answers is not the cluster's.
                "--bogus-priv",
                # Every query and where its answer came from (the cluster's records, or the
                # machine's nameserver: "forwarded"), in logs/dnsmasq.log: what a test reads to
                # see which names left the cluster.
                "--log-queries",
                f"--server={upstream_nameserver()}", "--log-facility=-",
            ],
            "dns-records": [
                sys.executable, str(Path(__file__).with_name("dns_records.py")), f"--kubeconfig={kubeconfig}",
                f"--out={self.dns_dir / 'hosts'}", f"--domain={DOMAIN}",
            ],
            # The API server's own: it calls webhooks at their Service's ClusterIP.
            "kube-proxy-host": [
                str(binaries.kube_proxy), f"--kubeconfig={kubeconfig}", "--proxy-mode=iptables",
                f"--cluster-cidr={CLUSTER_CIDR}", "--hostname-override=multiworld-host",
                f"--bind-address={self.ip}", "--conntrack-max-per-core=0",
                "--metrics-bind-address=127.0.0.1:10249", "--healthz-bind-address=127.0.0.1:10256",
            ],
            "kube-scheduler": [
                str(binaries.kube_scheduler), f"--kubeconfig={kubeconfig}", "--leader-elect=false",
                "--secure-port=0", "--port=0",
            ],
        }  # fmt: skip

    def resolves(self, name: str) -> bool:
        """Whether the cluster's DNS answers `name` with an address."""
        try:
            return bool(query_a(self.ip, name))
        except OSError:
            return False

    # ---- stop --------------------------------------------------------------------------------

    def owns_host(self) -> bool:
        """Whether the machine's nodes may be these: the marker names no other folder's. (A
        cluster refused because another's nodes run must leave them alone: they share the
        nodes' names, the bridge and the rules.)"""
        if not MARKER.exists():
            return True
        ours = {node.directory for node in self.nodes}
        return {node.directory for node in _marked_nodes(json.loads(MARKER.read_text()))} <= ours

    def cleanup_host(self) -> None:
        """Undo the nodes' host changes once their daemons are stopped: each node's namespaces,
        links, mounts and cgroup, the node bridge, pod network namespace files, iptables chains
        and rules, sysctls. Safe to run twice and after a crash; a no-op while the machine's
        nodes are another folder's."""
        if not self.owns_host():
            return
        for node in self.nodes:
            node.cleanup()
        pod_namespaces = [*Path("/run/netns").glob("cni-*")]
        unmount_under(pod_namespaces)
        for netns in pod_namespaces:
            netns.unlink(missing_ok=True)
        for bridge in (BRIDGE, LEGACY_BRIDGE):
            subprocess.run(["ip", "link", "delete", bridge], capture_output=True, check=False)
        for tool in ("iptables", "ip6tables"):
            remove_rules(tool, RULE_COMMENT)
        remove_cgroup("kubepods")  # a node of the host's own namespace used the default cgroupRoot
        if MARKER.exists():
            for key, value in json.loads(MARKER.read_text())["sysctls"].items():
                if value is not None:
                    write_sysctl(key, value)
            MARKER.unlink()


def _marked_nodes(marker: dict[str, object]) -> list[Node]:
    """The nodes a marker names (one written before nodes had numbers names a folder only)."""
    listed = marker.get("nodes") or [[marker["directory"], 1]]
    assert isinstance(listed, list)
    return [Node(Path(directory), int(index)) for directory, index in listed]
