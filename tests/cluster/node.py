"""One real Kubernetes node on this machine, beside the control plane of cluster.py.

containerd (Debian) runs the pods, kubelet and kube-scheduler (built from Debian's kubernetes
source, like the API server) place and start them, Debian's CNI plugins give them a bridge
network (`cni0`, 10.244.0.0/24), kube-proxy makes ClusterIP Services (the in-cluster
`kubernetes` Service among them) reachable from pods, and dnsmasq answers cluster DNS on the
node address from records that dns_records.py keeps up to date.

The node changes the host (a bridge, iptables rules, a few sysctls, mounts), so one node runs
per machine; `cleanup_host` undoes every change, also after a crash. Images live in a containerd
root under the cache, so they survive node restarts; see images.py for loading ours.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("multiworld.test_cluster")

NAME = "multiworld-node"
POD_SUBNET = "10.244.0.0/24"
CLUSTER_CIDR = "10.244.0.0/16"
BRIDGE = "cni0"
DOMAIN = "cluster.local"
PAUSE_IMAGE = "docker.io/multiworld/pause:3.4"
# Marks the machine's one node: which folder runs it (so a second `up` is refused by name).
MARKER = Path("/run/multiworld-node.json")
RULE_COMMENT = "multiworld-node"
CHAIN_PREFIXES = ("KUBE-", "CNI-")
# The host settings kubelet, kube-proxy and the pod network change; restored on cleanup.
SYSCTLS = (
    "vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.ipv4.ip_forward",
    "net.ipv4.conf.all.route_localnet",
)  # fmt: skip
# Daemons in start order; they stop in reverse, containerd last (its pods are removed first).
DAEMONS = ("containerd", "dnsmasq", "dns-records", "kube-proxy", "kubelet", "kube-scheduler")


class NodeError(RuntimeError):
    """The node could not be started; the message says why."""


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


def node_ip() -> str:
    """The host's own address (the default route's source): pods reach the API server and DNS there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # no packet is sent: this only picks a route
        except OSError as error:
            raise NodeError(f"no default route to pick the node address from: {error}") from error
        return str(probe.getsockname()[0])


def containerd_root() -> Path:
    """containerd's image store, kept across node restarts (our images take minutes to import)."""
    version = subprocess.run(["containerd", "--version"], capture_output=True, text=True, check=True)
    tag = hashlib.sha256(version.stdout.encode()).hexdigest()[:12]
    cache = Path(
        os.environ.get("MULTIWORLD_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multiworld"
    )
    return cache / f"containerd-{tag}"


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


def run(argv: list[str], what: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NodeError(f"{what} failed ({shlex.join(argv)}): {(result.stderr or result.stdout).strip()[-2000:]}")
    return result.stdout


class Node:
    """The files of one node in `directory` (configs, kubelet root, containerd state, DNS records)."""

    def __init__(self, directory: Path, ip: str) -> None:
        self.directory = directory
        self.ip = ip
        # Unix socket paths are limited to about 100 bytes, which a test's temp folder exceeds:
        # containerd and kubelet (whose root holds sockets) live in a short folder of their own;
        # the node's folder links to containerd's socket.
        self.run_dir = Path("/var/lib") / f"multiworld-node-{hashlib.sha256(str(directory).encode()).hexdigest()[:8]}"
        self.socket = self.run_dir / "containerd.sock"
        self.socket_link = directory / "containerd" / "containerd.sock"
        self.kubelet_root = self.run_dir / "kubelet"
        self.dns_dir = directory / "dns"

    @functools.cached_property
    def root(self) -> Path:
        """containerd's image store; asked for only when the node starts (describing a node runs
        no binary: containerd may not be installed yet)."""
        return containerd_root()

    # ---- start -------------------------------------------------------------------------------

    def claim_host(self) -> None:
        """Refuse when another folder's node runs; clear what a crashed one left; save sysctls."""
        if MARKER.exists():
            owner = Path(json.loads(MARKER.read_text())["directory"])
            if owner != self.directory and _listening(Node(owner, self.ip).socket):
                raise NodeError(
                    f"a node already runs on this machine from {owner} (one per machine: it owns "
                    f"{BRIDGE} and the pod network); stop it first (`make cluster-down` for .cluster/)"
                )
            Node(owner, self.ip).cleanup_host()
        self.cleanup_host()
        saved = {key: _read_sysctl(key) for key in SYSCTLS}
        MARKER.write_text(json.dumps({"directory": str(self.directory), "sysctls": saved}))
        _write_sysctl("net.ipv4.ip_forward", "1")
        for direction in ("-i", "-o"):
            # dockerd with iptables sets FORWARD's policy to DROP, and bridged pod traffic goes
            # through FORWARD: accept the pod bridge explicitly.
            run(["iptables", "-w", "-I", "FORWARD", direction, BRIDGE, "-m", "comment",
                 "--comment", RULE_COMMENT, "-j", "ACCEPT"], "allowing pod traffic")  # fmt: skip

    def write_configs(self) -> None:
        for folder in ("containerd", "cni", "cni-ipam", "dns"):
            (self.directory / folder).mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.directory / "containerd" / "config.toml").write_text(self._containerd_config())
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.socket_link.unlink(missing_ok=True)
        self.socket_link.symlink_to(self.socket)
        (self.directory / "cni" / "10-multiworld.conflist").write_text(json.dumps(self._cni_config(), indent=2))
        (self.directory / "kubelet-config.json").write_text(json.dumps(self._kubelet_config(), indent=2))
        (self.dns_dir / "hosts").write_text("")

    def commands(self, binaries: NodeBinaries, kubeconfig: Path, node_kubeconfig: Path) -> dict[str, list[str]]:
        """Each daemon's argv; kube-proxy, the scheduler and the DNS feed act as the admin."""
        return {
            "containerd": ["containerd", "--config", str(self.directory / "containerd" / "config.toml")],
            "dnsmasq": [
                "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--user=root", "--pid-file=",
                f"--listen-address={self.ip}", "--bind-interfaces", "--no-hosts", "--no-resolv",
                f"--hostsdir={self.dns_dir}", f"--local=/{DOMAIN}/", "--no-negcache",
                f"--server={upstream_nameserver()}", "--log-facility=-",
            ],
            "dns-records": [
                sys.executable, str(Path(__file__).with_name("dns_records.py")), f"--kubeconfig={kubeconfig}",
                f"--out={self.dns_dir / 'hosts'}", f"--domain={DOMAIN}",
            ],
            "kube-proxy": [
                str(binaries.kube_proxy), f"--kubeconfig={kubeconfig}", "--proxy-mode=iptables",
                f"--cluster-cidr={CLUSTER_CIDR}", f"--hostname-override={NAME}",
                "--conntrack-max-per-core=0", "--metrics-bind-address=127.0.0.1:10249",
                "--healthz-bind-address=127.0.0.1:10256",
            ],
            "kubelet": [
                str(binaries.kubelet), f"--config={self.directory / 'kubelet-config.json'}",
                f"--kubeconfig={node_kubeconfig}", "--container-runtime=remote",
                f"--container-runtime-endpoint=unix://{self.socket}",
                f"--root-dir={self.kubelet_root}", f"--cert-dir={self.directory / 'kubelet-pki'}",
                f"--hostname-override={NAME}", f"--node-ip={self.ip}",
            ],
            "kube-scheduler": [
                str(binaries.kube_scheduler), f"--kubeconfig={kubeconfig}", "--leader-elect=false",
                "--secure-port=0", "--port=0",
            ],
        }  # fmt: skip

    def wait_for_runtime(self, check_alive: Callable[[], None], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._ctr_ok():
            check_alive()
            if time.monotonic() > deadline:
                raise NodeError(f"containerd did not serve on {self.socket} within {timeout:.0f} s")
            time.sleep(0.1)

    def import_pause_image(self, pause: Path) -> None:
        """The sandbox image: pause.c from the kubernetes source, one static binary in one layer."""
        self.ctr(["image", "import", "-"], stdin=_one_file_image(pause, PAUSE_IMAGE), what="importing the pause image")

    def resolves(self, name: str) -> bool:
        """Whether the node's DNS answers `name` with an address."""
        try:
            return bool(query_a(self.ip, name))
        except OSError:
            return False

    def ctr(self, args: list[str], what: str, stdin: bytes | None = None) -> str:
        result = subprocess.run(["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args],
                                input=stdin, capture_output=True, check=False)  # fmt: skip
        if result.returncode != 0:
            raise NodeError(f"{what} failed: {result.stderr.decode(errors='replace').strip()[-2000:]}")
        return result.stdout.decode()

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
        return {
            "cniVersion": "0.4.0",
            "name": "multiworld",
            "plugins": [
                {
                    "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
                    "ipam": {
                        "type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
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
            "failSwapOn": False,
            "clusterDNS": [self.ip],
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
        while time.monotonic() < deadline and _shims(self.socket):
            for task in self.ctr(["tasks", "ls", "-q"], "listing tasks").split():
                subprocess.run(["ctr", "--address", str(self.socket), "-n", "k8s.io", "tasks", "rm", "-f", task],
                               capture_output=True, check=False)  # fmt: skip
            time.sleep(0.2)
        containers = self.ctr(["containers", "ls", "-q"], "listing containers").split()
        if containers:
            subprocess.run(["ctr", "--address", str(self.socket), "-n", "k8s.io", "containers", "rm", *containers],
                           capture_output=True, check=False)  # fmt: skip

    def cleanup_host(self) -> None:
        """Undo the node's host changes: processes, mounts, network namespaces, the bridge,
        iptables chains and rules, sysctls. Safe to run twice and after a crash."""
        for pid in _shims(self.socket):
            _kill_tree(pid)
        _unmount_under([self.directory, self.run_dir, self.root, Path("/run/netns"), Path("/var/run/netns")])
        for netns in Path("/run/netns").glob("cni-*"):
            netns.unlink(missing_ok=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
        for tool in ("iptables", "ip6tables"):
            _remove_rules(tool)
        _remove_cgroups()
        if MARKER.exists():
            marker = json.loads(MARKER.read_text())
            if Path(marker["directory"]) == self.directory:
                for key, value in marker["sysctls"].items():
                    if value is not None:
                        _write_sysctl(key, value)
                MARKER.unlink()


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


def _read_sysctl(key: str) -> str | None:
    try:
        return Path("/proc/sys", *key.split(".")).read_text().strip()
    except OSError:
        return None


def _write_sysctl(key: str, value: str) -> None:
    Path("/proc/sys", *key.split(".")).write_text(value + "\n")


def _processes() -> dict[int, tuple[int, list[str]]]:
    """pid -> (parent pid, argv) of every process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        found[int(entry.name)] = (parent, argv)
    return found


def _listening(unix_socket: Path) -> bool:
    """Whether a process serves `unix_socket`: a killed node (its machine snapshotted, its
    session cut off) leaves the file behind, which must not block the next node."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(unix_socket))
        except OSError:
            return False
    return True


def _shims(containerd_socket: Path) -> list[int]:
    """The containerd shims serving this node's containerd (they outlive it by design)."""
    return [
        pid for pid, (_, argv) in _processes().items()
        if argv and Path(argv[0]).name.startswith("containerd-shim") and str(containerd_socket) in argv
    ]  # fmt: skip


def _kill_tree(root: int) -> None:
    processes = _processes()
    doomed, frontier = [root], [root]
    while frontier:
        children = [pid for pid, (parent, _) in processes.items() if parent in frontier]
        doomed += children
        frontier = children
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _unmount_under(folders: Iterable[Path]) -> None:
    prefixes = [str(folder.resolve()) if folder.exists() else str(folder) for folder in folders]
    for _ in range(3):  # a lazy unmount can reveal a mount below it
        points = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].encode().decode("unicode_escape")
            if any(point == prefix or point.startswith(prefix + "/") for prefix in prefixes):
                points.append(point)
        if not points:
            return
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def _remove_rules(tool: str) -> None:
    """Remove our FORWARD rules and every KUBE-*/CNI-* chain with the rules that jump to it."""
    dump = subprocess.run([f"{tool}-save"], capture_output=True, text=True, check=False).stdout
    table, chains = "", []
    for line in dump.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":") and line[1:].startswith(CHAIN_PREFIXES):
            chains.append((table, line[1:].split()[0]))
        elif line.startswith("-A "):
            words = shlex.split(line)
            target = words[words.index("-j") + 1] if "-j" in words else ""
            own = not words[1].startswith(CHAIN_PREFIXES)
            if own and (target.startswith(CHAIN_PREFIXES) or RULE_COMMENT in words):
                subprocess.run([tool, "-w", "-t", table, "-D", *words[1:]], capture_output=True, check=False)
    for action in ("-F", "-X"):
        for table, chain in chains:
            subprocess.run([tool, "-w", "-t", table, action, chain], capture_output=True, check=False)


def _remove_cgroups() -> None:
    """kubelet's `kubepods` cgroups (empty once the pods are killed), deepest first."""
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / "kubepods"
        if not top.is_dir():
            continue
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                folder.rmdir()
            except OSError:
                pass
        try:
            top.rmdir()
        except OSError:
            pass
