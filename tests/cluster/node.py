"""One real Kubernetes node on this machine, beside the control plane of cluster.py.

A node is a kubelet, a containerd and a kube-proxy in a network namespace of its own (named
after the node), joined to the host by a veth pair whose host end is a port of the machine's
node bridge (nodes.py): its own address (10.243.0.1N), its own pod network (10.244.N-1.0/24 on
its own `cni0`, Debian's bridge CNI plugin), routes to the other nodes' pod networks. The
kubelet and containerd also share a mount namespace of the node's own (a slave of the host's),
where the folders every kubelet and containerd would share on one machine are the node's
private ones: the device plugins' folder (whose socket path the 1.20 kubelet fixes), the CNI
result cache, the pod logs (each kubelet removes the log folders of pods it does not know) and
containerd's runc state. Its pods live in the cgroup /<node name> (the kubelet's cgroupRoot).
Beside its kubelet, in the same namespaces, runs the test device plugin (device_plugin/): the node
shows GPUS_PER_NODE `nvidia.com/gpu` in its capacity, and a container given some sees their ids
in NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES.

Faults, as a fleet meets them: `cut` drops every packet in and out of the node's link inside
its namespace (peers hear silence, not resets), `mend` lets them through again, and
`kill_workloads` kills every container and shim of the node (its daemons are the cluster's to
kill: cluster.py's power_off).

Images live in a containerd root under the cache, one per node, so they survive node restarts;
see images.py for loading ours.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.host import (
    NodeError,
    cgroup_pids,
    enter_namespaces,
    kill,
    kill_tree,
    listening,
    make_cgroup,
    remove_cgroup,
    run,
    shims,
    unmount_under,
)

log = logging.getLogger("multiworld.test_cluster")

__all__ = ["GPUS_PER_NODE", "GPU_RESOURCE", "NAME", "MAX_NODES", "Node", "NodeBinaries", "NodeError", "node_name"]

NAME = "multiworld-node"  # the first node's name; the others are NAME-2, NAME-3
MAX_NODES = 3
NODE_NETWORK = "10.243.0.0/24"
GATEWAY = "10.243.0.1"  # the host's end of the node bridge
CLUSTER_CIDR = "10.244.0.0/16"
BRIDGE = "cni0"  # each node's pod bridge, in its own namespace
LINK = "eth0"  # the node's end of its veth pair, in its namespace
DOMAIN = "cluster.local"
PAUSE_IMAGE = "docker.io/multiworld/pause:3.4"
# Tags the rules that cut a node off (inside its namespace).
CUT_COMMENT = "multiworld-cut"
# Folders every kubelet or containerd on a machine would share, each a private one per node
# (bound over them in the node's mount namespace): its name under the node's run folder.
PRIVATE_FOLDERS = {
    Path("/var/lib/kubelet/device-plugins"): "device-plugins",
    Path("/var/lib/cni"): "cni-cache",
    Path("/var/log/pods"): "pod-logs",
    Path("/var/log/containers"): "container-logs",
    Path("/run/containerd"): "run-containerd",
}
# The node's daemons in start order; they stop in reverse, containerd last (its pods removed first).
# The device plugin starts after the kubelet (it registers with it) and again whenever it does.
DAEMONS = ("containerd", "kube-proxy", "kubelet", "device-plugin")
# What the device plugin advertises on each node.
GPU_RESOURCE = "nvidia.com/gpu"
GPUS_PER_NODE = 4
REPO_ROOT = Path(__file__).resolve().parents[2]


def node_name(index: int) -> str:
    return NAME if index == 1 else f"{NAME}-{index}"


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    kube_scheduler: Path
    kube_proxy: Path
    pause: Path
    kubectl: Path

    @classmethod
    def in_folder(cls, folder: Path) -> NodeBinaries:
        return cls(*(folder / name for name in ("kubelet", "kube-scheduler", "kube-proxy", "pause", "kubectl")))


def grpc_python() -> str:
    """A Python that has grpcio, for the device plugin: this one, or the repository's venv's
    (`make cluster` runs this module with the system's python3)."""
    if importlib.util.find_spec("grpc") is not None:
        return sys.executable
    venv = REPO_ROOT / ".venv" / "bin" / "python"
    if venv.exists():
        return str(venv)
    raise NodeError(
        f"the nodes' device plugin needs grpcio, which {sys.executable} lacks and no {venv} exists: "
        "`make check` makes the venv (the dev extra has grpcio)"
    )


def cache_folder() -> Path:
    return Path(
        os.environ.get("MULTIWORLD_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multiworld"
    )


def containerd_root(index: int = 1) -> Path:
    """A node's image store, kept across node restarts (our images take minutes to import)."""
    version = subprocess.run(["containerd", "--version"], capture_output=True, text=True, check=True)
    tag = hashlib.sha256(version.stdout.encode()).hexdigest()[:12]
    return cache_folder() / (f"containerd-{tag}" if index == 1 else f"containerd-{tag}-{index}")


class Node:
    """Node number `index` (1 to MAX_NODES), its files in `directory` (configs, kubeconfig,
    containerd state, CNI addresses); `host_ip` is where the control plane and DNS serve it."""

    def __init__(self, directory: Path, index: int = 1, host_ip: str = "") -> None:
        if not 1 <= index <= MAX_NODES:
            raise NodeError(f"node numbers run from 1 to {MAX_NODES}, got {index}")
        self.directory = directory
        self.index = index
        self.host_ip = host_ip
        self.name = node_name(index)
        self.ip = f"10.243.0.{10 + index}"
        self.pod_subnet = f"10.244.{index - 1}.0/24"
        self.netns = self.name
        self.veth = f"mwnode{index}"  # the host's end
        self.cgroup_root = self.name
        # Unix socket paths are limited to about 100 bytes, which a test's temp folder exceeds:
        # containerd and kubelet (whose root holds sockets) live in a short folder of their own;
        # the node's folder links to containerd's socket.
        self.run_dir = Path("/var/lib") / f"multiworld-node-{hashlib.sha256(str(directory).encode()).hexdigest()[:8]}"
        self.socket = self.run_dir / "containerd.sock"
        self.socket_link = directory / "containerd" / "containerd.sock"
        self.kubelet_root = self.run_dir / "kubelet"
        # The mount namespace's file, on a private mount of its own (a namespace file may not be
        # bound on a shared one).
        self.namespace_dir = self.run_dir / "ns"
        self.mount_namespace = self.namespace_dir / "mnt"
        self.kubeconfig = directory / "kubeconfig"

    def daemon(self, name: str) -> str:
        """The name of this node's `name` daemon among the cluster's (pid file, log)."""
        return name if self.index == 1 else f"{name}-{self.index}"

    @property
    def user(self) -> str:
        """The kubelet's user: the Node authorizer lets it read and write its own Node only."""
        return f"system:node:{self.name}"

    @functools.cached_property
    def root(self) -> Path:
        """containerd's image store; asked for only when the node starts (describing a node runs
        no binary: containerd may not be installed yet)."""
        return containerd_root(self.index)

    # ---- start -------------------------------------------------------------------------------

    def write_configs(self) -> None:
        for folder in ("containerd", "cni", "cni-ipam"):
            (self.directory / folder).mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.directory / "containerd" / "config.toml").write_text(self._containerd_config())
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.socket_link.unlink(missing_ok=True)
        self.socket_link.symlink_to(self.socket)
        (self.directory / "cni" / "10-multiworld.conflist").write_text(json.dumps(self._cni_config(), indent=2))
        (self.directory / "kubelet-config.json").write_text(json.dumps(self._kubelet_config(), indent=2))

    def make_namespaces(self, bridge: str, peers: list[Node]) -> None:
        """The node's network namespace (its veth on `bridge`, its address, a default route to
        the host and a route to each peer's pod network), its mount namespace with its private
        folders, and its cgroup."""
        run(["ip", "netns", "add", self.netns], f"making {self.name}'s network namespace")
        run(["ip", "link", "add", self.veth, "type", "veth", "peer", "name", LINK, "netns", self.netns],
            f"making {self.name}'s link")  # fmt: skip
        run(["ip", "link", "set", self.veth, "master", bridge, "up"], f"plugging {self.name} into {bridge}")
        inside = ["ip", "-n", self.netns]
        run([*inside, "link", "set", "lo", "up"], f"{self.name}'s loopback")
        run([*inside, "addr", "add", f"{self.ip}/24", "dev", LINK], f"{self.name}'s address")
        run([*inside, "link", "set", LINK, "up"], f"{self.name}'s link up")
        run([*inside, "route", "add", "default", "via", GATEWAY], f"{self.name}'s default route")
        for peer in peers:
            if peer is not self:
                run([*inside, "route", "add", peer.pod_subnet, "via", peer.ip], f"{self.name}'s route to {peer.name}")
        run(["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"], f"{self.name}'s forwarding", self.enter_network)
        self.namespace_dir.mkdir(parents=True, exist_ok=True)
        run(["mount", "--bind", str(self.namespace_dir), str(self.namespace_dir)], "binding the namespace folder")
        run(["mount", "--make-private", str(self.namespace_dir)], "making the namespace folder private")
        self.mount_namespace.touch()
        run(["unshare", f"--mount={self.mount_namespace}", "--propagation", "slave", "true"],
            f"making {self.name}'s mount namespace")  # fmt: skip
        for shared, private in PRIVATE_FOLDERS.items():
            shared.mkdir(parents=True, exist_ok=True)
            (self.run_dir / private).mkdir(exist_ok=True)
            run(["mount", "--bind", str(self.run_dir / private), str(shared)], f"{self.name}'s private {shared}",
                self.enter)  # fmt: skip
        make_cgroup(self.cgroup_root)

    def enter(self) -> None:
        """In a child before exec: into the node's network and mount namespaces."""
        enter_namespaces(Path("/run/netns") / self.netns, self.mount_namespace)

    def enter_network(self) -> None:
        enter_namespaces(Path("/run/netns") / self.netns, None)

    def commands(self, binaries: NodeBinaries, admin_kubeconfig: Path) -> dict[str, list[str]]:
        """Each daemon's argv, all run in the node's namespaces; kube-proxy acts as the admin."""
        return {
            "containerd": ["containerd", "--config", str(self.directory / "containerd" / "config.toml")],
            "kube-proxy": [
                str(binaries.kube_proxy), f"--kubeconfig={admin_kubeconfig}", "--proxy-mode=iptables",
                f"--cluster-cidr={CLUSTER_CIDR}", f"--hostname-override={self.name}",
                "--conntrack-max-per-core=0", "--metrics-bind-address=127.0.0.1:10249",
                "--healthz-bind-address=127.0.0.1:10256",
            ],
            "kubelet": [
                str(binaries.kubelet), f"--config={self.directory / 'kubelet-config.json'}",
                f"--kubeconfig={self.kubeconfig}", "--container-runtime=remote",
                f"--container-runtime-endpoint=unix://{self.socket}",
                f"--root-dir={self.kubelet_root}", f"--cert-dir={self.directory / 'kubelet-pki'}",
                f"--hostname-override={self.name}", f"--node-ip={self.ip}",
            ],
            # In the node's mount namespace: its private device plugin folder, the kubelet's.
            "device-plugin": [grpc_python(), "-m", "tests.cluster.device_plugin", f"--devices={GPUS_PER_NODE}"],
        }  # fmt: skip

    def wait_for_runtime(self, check_alive: Callable[[], None], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._ctr_ok():
            check_alive()
            if time.monotonic() > deadline:
                raise NodeError(f"containerd of {self.name} did not serve on {self.socket} within {timeout:.0f} s")
            time.sleep(0.1)

    def import_pause_image(self, pause: Path) -> None:
        """The sandbox image: pause.c from the kubernetes source, one static binary in one layer."""
        self.ctr(["image", "import", "-"], stdin=_one_file_image(pause, PAUSE_IMAGE), what="importing the pause image")

    def ctr(self, args: list[str], what: str, stdin: bytes | None = None) -> str:
        result = subprocess.run(["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args],
                                input=stdin, capture_output=True, check=False)  # fmt: skip
        if result.returncode != 0:
            raise NodeError(f"{what} failed: {result.stderr.decode(errors='replace').strip()[-2000:]}")
        return result.stdout.decode()

    def serving(self) -> bool:
        """Whether the node's containerd serves its socket."""
        return listening(self.socket)

    def _ctr_ok(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            self.ctr(["version"], "asking containerd its version")
        except NodeError:
            return False
        return True

    def _containerd_config(self) -> str:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""version = 2
root = "{self.root}"
state = "{self.directory / "containerd" / "state"}"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # These machines lack CAP_SYS_RESOURCE: kubelet's oom_score_adj of -998 would fail every sandbox.
  restrict_oom_score_adj = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{self.directory / "cni"}"
"""

    def _cni_config(self) -> dict[str, object]:
        # No masquerade on the node: a pod reaches pods of other nodes with its own address (the
        # host masquerades what leaves the machine).
        return {
            "cniVersion": "0.4.0",
            "name": "multiworld",
            "plugins": [
                {
                    "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
                    "ipam": {
                        "type": "host-local", "ranges": [[{"subnet": self.pod_subnet}]],
                        "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(self.directory / "cni-ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }  # fmt: skip

    def _kubelet_config(self) -> dict[str, object]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.ip,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "cgroupDriver": "cgroupfs",
            # The node's pods under a cgroup of its own (two kubelets would both manage /kubepods).
            "cgroupRoot": f"/{self.cgroup_root}",
            "failSwapOn": False,
            "clusterDNS": [self.host_ip],
            "clusterDomain": DOMAIN,
            # The API server reaches kubelet for logs and exec; a throwaway node trusts it.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            # Our images are imported, never pulled: never collect them; a nearly full test
            # disk must not evict pods.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "50Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "serializeImagePulls": False,
        }

    # ---- faults ------------------------------------------------------------------------------

    def _cut_rules(self) -> list[list[str]]:
        """Every packet in through the node's link dropped before anything sees it (raw), every
        packet out dropped last (mangle POSTROUTING: the node's own and its pods' alike). DROP
        answers nothing: no RST, no ICMP."""
        tag = ["-m", "comment", "--comment", CUT_COMMENT, "-j", "DROP"]
        return [["-t", "raw", "PREROUTING", "-i", LINK, *tag], ["-t", "mangle", "POSTROUTING", "-o", LINK, *tag]]

    def cut(self) -> None:
        """Cut the node off the network: peers hear silence, as from a pulled cable."""
        for table, table_name, chain, *rule in self._cut_rules():
            if not self._has_rule(table_name, chain, rule):
                run(["iptables", "-w", table, table_name, "-I", chain, "1", *rule], f"cutting {self.name} off",
                    self.enter_network)  # fmt: skip

    def mend(self) -> None:
        """Let the node's packets through again."""
        for table, table_name, chain, *rule in self._cut_rules():
            while self._has_rule(table_name, chain, rule):
                run(["iptables", "-w", table, table_name, "-D", chain, *rule], f"mending {self.name}",
                    self.enter_network)  # fmt: skip

    def is_cut(self) -> bool:
        return any(self._has_rule(table_name, chain, rule) for _, table_name, chain, *rule in self._cut_rules())

    def _has_rule(self, table: str, chain: str, rule: list[str]) -> bool:
        if not (Path("/run/netns") / self.netns).exists():
            return False
        check = subprocess.run(["iptables", "-w", "-t", table, "-C", chain, *rule], capture_output=True,
                               check=False, preexec_fn=self.enter_network)  # fmt: skip
        return check.returncode == 0

    def kill_workloads(self) -> None:
        """SIGKILL every process of the node's pods (its cgroup) and the shims that ran them."""
        deadline = time.monotonic() + 10
        while True:
            doomed = shims(self.socket) + sorted(cgroup_pids(self.cgroup_root))
            if not doomed:
                return
            if time.monotonic() > deadline:
                raise NodeError(f"processes of {self.name} outlived SIGKILL for 10 s: {doomed}")
            kill(doomed)
            time.sleep(0.05)

    # ---- stop --------------------------------------------------------------------------------

    def remove_pods(self) -> None:
        """With containerd still serving (kubelet stopped): kill every task and drop every
        container, so the kept image store holds no stale sandbox for the next node."""
        if not self._ctr_ok():
            return
        for task in self.ctr(["tasks", "ls", "-q"], "listing tasks").split():
            subprocess.run(["ctr", "--address", str(self.socket), "-n", "k8s.io",
                            "tasks", "kill", "-s", "SIGKILL", task],
                           capture_output=True, check=False)  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and shims(self.socket):
            for task in self.ctr(["tasks", "ls", "-q"], "listing tasks").split():
                subprocess.run(["ctr", "--address", str(self.socket), "-n", "k8s.io", "tasks", "rm", "-f", task],
                               capture_output=True, check=False)  # fmt: skip
            time.sleep(0.2)
        containers = self.ctr(["containers", "ls", "-q"], "listing containers").split()
        if containers:
            subprocess.run(["ctr", "--address", str(self.socket), "-n", "k8s.io", "containers", "rm", *containers],
                           capture_output=True, check=False)  # fmt: skip

    def cleanup(self) -> None:
        """Undo what the node did to the host once its daemons are stopped: its shims and
        containers, namespaces, link, mounts, cgroup and run folder. Safe to run twice and after
        a crash."""
        for pid in shims(self.socket):
            kill_tree(pid)
        kill(cgroup_pids(self.cgroup_root))
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "delete", self.veth], capture_output=True, check=False)
        unmount_under([self.directory, self.run_dir, self.root])
        shutil.rmtree(self.run_dir, ignore_errors=True)
        remove_cgroup(self.cgroup_root)


def _one_file_image(binary: Path, name: str) -> bytes:
    """A `docker save` archive of an image holding `binary` as /pause (no docker needed)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        tar.add(binary, arcname="pause")
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode()  # fmt: skip
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    repo, tag = name.removeprefix("docker.io/").rsplit(":", 1)
    manifest = json.dumps(
        [{"Config": config_name, "RepoTags": [f"{repo}:{tag}"], "Layers": ["layer/layer.tar"]}]
    ).encode()
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for member, data in (("layer/layer.tar", layer_bytes), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive.getvalue()
