"""A real, local Kubernetes cluster: etcd, kube-apiserver, kube-controller-manager and, with
`--nodes N` (1 to 3), N real nodes (node.py: each a kubelet, containerd and kube-proxy in
namespaces of its own, with its own address and pod network, routed to the others, and the test
device plugin: 4 `nvidia.com/gpu` a node) and what
they share on the host (node_host.py: the node bridge, kube-scheduler, cluster DNS).

The control plane listens on ports picked free at start, so several control planes can run side
by side; without a node it serves on loopback and Pods stay Pending unless someone writes their
status. With nodes it serves on the host's address, which nodes and pods reach; one set of
nodes runs per machine.

From the repository root (standard library only: any Python 3.11 runs it):

    python3 -m tests.cluster.cluster up     # start in .cluster/, write .cluster/kubeconfig
    python3 -m tests.cluster.cluster up --nodes 3   # three nodes; --nodes 0: the control plane alone
    python3 -m tests.cluster.cluster env    # print `export KUBECONFIG=...` and PATH with kubectl
    python3 -m tests.cluster.cluster down   # stop (apiserver before etcd)
    python3 -m tests.cluster.cluster binaries  # resolve or build the binaries, print their paths
    python3 -m tests.cluster.cluster power-off NODE  # network cut, then its daemons and pods killed
    python3 -m tests.cluster.cluster partition NODE  # network cut, everything on it left running
    python3 -m tests.cluster.cluster heal NODE       # network back; a powered-off node started again

NODE is a node's name (multiworld-node, multiworld-node-2, ...) or number (1, 2, ...).
Tests and benches import it as `tests.cluster.cluster` and use `find_binaries`, `Cluster` (its
`power_off`, `partition` and `heal` among them), `ClusterError`, `wait_for` and `api_client_for`.
"""

from __future__ import annotations

import argparse
import calendar
import ctypes
import functools
import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tests.cluster.node import (
    DAEMONS as NODE_DAEMONS,
    GPU_RESOURCE,
    GPUS_PER_NODE,
    MAX_NODES,
    Node,
    NodeBinaries,
    NodeError,
)
from tests.cluster.node_host import DAEMONS as HOST_DAEMONS, NodeHost, host_ip, node_folder, nodes_in

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

T = TypeVar("T")

log = logging.getLogger("multiworld.test_cluster")

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
BUILD_SCRIPT = HERE / "build.sh"
DEFAULT_DIR = REPO_ROOT / ".cluster"

SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc"
SERVICE_CLUSTER_IP = "10.96.0.1"  # the `kubernetes` Service
ADMIN_USER = "admin"
# The control plane stops last, the apiserver before etcd (it keeps retrying etcd for about a
# minute if etcd goes first).
CONTROL_PLANE = ("kube-controller-manager", "kube-apiserver", "etcd")
# The control plane's ports (free_port): below the worlds' store ports of a local run (20000 on)
# and the kernel's ephemeral ports (32768 on, by default).
CONTROL_PLANE_PORTS = range(15000, 20000)


class ClusterError(RuntimeError):
    """The control plane could not be provided; the message says why."""


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    # None when the user supplied an apiserver of their own without a matching controller-manager.
    kube_controller_manager: Path | None


def _asset_from_env(variable: str, name: str) -> Path | None:
    """A binary named by TEST_ASSET_<NAME>, else found in $KUBEBUILDER_ASSETS (envtest convention)."""
    explicit = os.environ.get(variable)
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ClusterError(f"{variable}={explicit} is not an executable file")
        return path
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        path = Path(assets) / name
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def build_binaries() -> Path:
    """Run build.sh (a no-op when the cache is complete) and return the cached assets folder."""
    # stderr is inherited so the build's progress lines show; stdout carries only the folder.
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise ClusterError(
            f"{BUILD_SCRIPT} failed with exit status {result.returncode} (see its output above); "
            "alternatively point KUBEBUILDER_ASSETS at a folder holding kube-apiserver and etcd"
        )
    return Path(result.stdout.strip().splitlines()[-1])


def find_binaries() -> Binaries:
    """Binaries from TEST_ASSET_* / KUBEBUILDER_ASSETS when given, otherwise the cached build."""
    etcd = _asset_from_env("TEST_ASSET_ETCD", "etcd")
    apiserver = _asset_from_env("TEST_ASSET_KUBE_APISERVER", "kube-apiserver")
    controller_manager = _asset_from_env("TEST_ASSET_KUBE_CONTROLLER_MANAGER", "kube-controller-manager")
    if etcd is not None and apiserver is not None:
        return Binaries(etcd, apiserver, controller_manager)
    built = build_binaries()
    return Binaries(
        etcd=etcd or built / "etcd",
        kube_apiserver=apiserver or built / "kube-apiserver",
        # A user-supplied apiserver is not paired with our 1.20 controller-manager.
        kube_controller_manager=controller_manager
        or (built / "kube-controller-manager" if apiserver is None else None),
    )


def find_node_binaries() -> NodeBinaries:
    """The node's binaries and kubectl: always the cached build (no envtest asset has them)."""
    return NodeBinaries.in_folder(build_binaries())


def free_port() -> int:
    """A port for a control-plane daemon, drawn from CONTROL_PLANE_PORTS: below the kernel's
    ephemeral ports, where only a deliberate bind takes one. An ephemeral one (what binding port
    0 picks) may go to any outgoing connection of the machine (the API server's own to etcd,
    say) between this call and the daemon's bind."""
    for port in random.sample(CONTROL_PLANE_PORTS, len(CONTROL_PLANE_PORTS)):
        with socket.socket() as probe:
            try:
                probe.bind(("", port))  # every interface, as the API server listens with a node
            except OSError:
                continue
        return port
    raise ClusterError(f"no free port in {CONTROL_PLANE_PORTS}")


@functools.cache
def _accepts_flag(binary: Path, flag: str) -> bool:
    """Whether `binary --help` lists `flag` (user-supplied binaries may be newer than 1.20)."""
    result = subprocess.run([str(binary), "--help"], capture_output=True, text=True, check=False)
    return f" {flag} " in result.stdout + result.stderr


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the starting process dies (no orphans)."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _kubeconfig(server: str, ca_file: Path, user: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "multiworld-test", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "multiworld-test", "user": user}}],
        "current-context": user,
    }


def write_kubeconfig(path: Path, server: str, ca_file: Path, user: str, token: str) -> Path:
    # JSON is valid YAML, so kubectl and the Python client read it as a kubeconfig.
    path.write_text(json.dumps(_kubeconfig(server, ca_file, user, token), indent=2) + "\n")
    path.chmod(0o600)
    return path


def _pid_alive(pid: int, program: str) -> bool:
    """True if `pid` runs `program`, its argv[0] (guards against a recycled pid; a zombie has no
    cmdline)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return cmdline.split(b"\0", 1)[0].decode(errors="replace") == program


class Cluster:
    """One control plane whose files (certs, data, logs, pid files, kubeconfig) live in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory.resolve()
        self.kubeconfig = self.directory / "kubeconfig"
        self.ca_file = self.directory / "pki" / "serving.crt"
        self.key_file = self.directory / "pki" / "serving.key"
        self.logs = self.directory / "logs"
        self.admin_token = ""
        self.has_controller_manager = False
        # The host's address when this cluster runs nodes: the control plane serves them there.
        self.host_ip: str | None = None
        # The nodes its folder holds (a stopped cluster's too, for `down`).
        self.nodes: list[Node] = nodes_in(self.directory)
        self.node_host = NodeHost(self.directory, self.nodes)
        self._node_tokens: dict[str, str] = {}
        self._detach = False
        # Handles of the processes this object started (reaped on stop); `down` from another
        # process works from the pid files alone.
        self._processes: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def node(self) -> Node:
        """The first node (the only one of a one-node cluster)."""
        return self.nodes[0] if self.nodes else Node(node_folder(self.directory, 1))

    def node_named(self, which: str | int) -> Node:
        """A node by its name or number (1, 2, ...)."""
        for node in self.nodes:
            if str(which) in (node.name, str(node.index)):
                return node
        raise ClusterError(f"no node {which!r} in {self.directory} (nodes: {', '.join(n.name for n in self.nodes)})")

    # ---- start -------------------------------------------------------------------------------

    def start(self, binaries: Binaries, *, detach: bool, nodes: int = 0, timeout: float = 60.0) -> None:
        """Start etcd, kube-apiserver and (if available) kube-controller-manager; wait for ready;
        then `nodes` nodes, until each is Ready and cluster DNS answers.

        Ready means /readyz answers 200 and, with a controller-manager, the `default`
        ServiceAccount exists (its controllers run, so Pods can be admitted).
        detach=False ties the processes to the calling thread (they get SIGTERM if it ends);
        detach=True leaves them running after the caller exits (`make cluster`).
        """
        if not 0 <= nodes <= MAX_NODES:
            raise ClusterError(f"nodes must be 0 to {MAX_NODES}, got {nodes}")
        running = self.running_components()
        if running:
            raise ClusterError(f"a cluster already runs in {self.directory} ({', '.join(running)})")
        self._reset_directory()
        self._detach = detach
        self.has_controller_manager = binaries.kube_controller_manager is not None
        started = time.monotonic()
        try:
            if nodes:
                self.require_controller_manager("a node (ServiceAccount tokens for its pods)")
                try:
                    self.host_ip = host_ip()
                except NodeError as error:
                    raise ClusterError(str(error)) from error
                self.nodes = nodes_in(self.directory, self.host_ip, nodes)
                self.node_host = NodeHost(self.directory, self.nodes, self.host_ip)
            self._make_credentials()
            etcd_url = self._start_etcd(binaries.etcd)
            self._start_apiserver(binaries, etcd_url)
            if binaries.kube_controller_manager is not None:
                # Started as soon as the apiserver serves (its own start-up then overlaps the
                # apiserver's post-start hooks); it waits up to 10 s for /healthz by itself.
                self._wait_until("kube-apiserver to serve", "/version", started, timeout)
                self._start_controller_manager(binaries.kube_controller_manager)
            self._wait_until("kube-apiserver /readyz", "/readyz?verbose", started, timeout)
            if binaries.kube_controller_manager is not None:
                self._wait_until(
                    "kube-controller-manager to create the default ServiceAccount",
                    "/api/v1/namespaces/default/serviceaccounts/default",
                    started,
                    timeout,
                )
            if nodes:
                self._start_nodes(find_node_binaries(), started, timeout + 120.0 * nodes)
        except BaseException:
            self.stop()
            raise
        log.info("ready in %.1f s: KUBECONFIG=%s", time.monotonic() - started, self.kubeconfig)

    def _start_nodes(self, binaries: NodeBinaries, started: float, timeout: float) -> None:
        try:
            self._start_node_daemons(binaries, started, timeout)
        except NodeError as error:
            raise ClusterError(str(error)) from error

    def _start_node_daemons(self, binaries: NodeBinaries, started: float, timeout: float) -> None:
        host = self.node_host
        host.claim_host()
        host.plug()
        for node in self.nodes:
            node.write_configs()
            self._spawn(node.daemon("containerd"), node.commands(binaries, self.kubeconfig)["containerd"], node)
        for node in self.nodes:
            self._serve_runtime(node, binaries)
        host_commands = host.commands(binaries, self.kubeconfig)
        for daemon in HOST_DAEMONS[:-1]:
            self._spawn(daemon, host_commands[daemon])
        for node in self.nodes:
            commands = node.commands(binaries, self.kubeconfig)
            for daemon in NODE_DAEMONS[1:]:
                self._spawn(node.daemon(daemon), commands[daemon], node)
        self._spawn(HOST_DAEMONS[-1], host_commands[HOST_DAEMONS[-1]])
        for node in self.nodes:
            self._wait_until(f"node {node.name} to be Ready with its GPUs", f"/api/v1/nodes/{node.name}", started,
                             timeout, accept=_node_ready_with_gpus)  # fmt: skip
        self._wait_until("the `kubernetes` Service's endpoints", "/api/v1/namespaces/default/endpoints/kubernetes",
                         started, timeout, accept=lambda body: bool(body.get("subsets")))  # fmt: skip

        # The DNS feed has run once and dnsmasq serves it.
        def dns_answers() -> bool:
            self.check_alive()
            return host.resolves("kubernetes.default.svc.cluster.local")

        wait_for(
            "cluster DNS to answer for kubernetes.default.svc",
            dns_answers,
            max(1.0, started + timeout - time.monotonic()),
        )

    def _serve_runtime(self, node: Node, binaries: NodeBinaries) -> None:
        """Once the node's containerd serves: no container left from an earlier run, the pause image."""
        node.wait_for_runtime(self.check_alive)
        node.remove_pods()
        node.import_pause_image(binaries.pause)

    def _reset_directory(self) -> None:
        stale = ["etcd-data", "pki", "logs", "dns", *(node_folder(Path(), i).name for i in range(1, MAX_NODES + 1))]
        for name in stale:
            shutil.rmtree(self.directory / name, ignore_errors=True)
        self.logs.mkdir(parents=True)
        (self.directory / "pki").mkdir(mode=0o700)

    def _make_credentials(self) -> None:
        # One key serves TLS and signs ServiceAccount tokens: this is a throwaway test cluster.
        # Pods reach the API server as the `kubernetes` Service (its ClusterIP and DNS names).
        names = [
            "IP:127.0.0.1",
            "DNS:localhost",
            f"IP:{SERVICE_CLUSTER_IP}",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
        if self.host_ip:
            names.append(f"IP:{self.host_ip}")
        subprocess.run(
            [
                # EC, not RSA: key generation is instant instead of up to a second.
                "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                "-nodes", "-days", "3650",
                "-subj", "/CN=127.0.0.1",
                "-addext", "subjectAltName=" + ",".join(names),
                "-keyout", str(self.key_file), "-out", str(self.ca_file),
            ],
            check=True, capture_output=True,
        )  # fmt: skip
        self.admin_token = secrets.token_hex(24)
        # One credential per kubelet: the Node authorizer lets each change its own Node only.
        self._node_tokens = {node.user: secrets.token_hex(24) for node in self.nodes}
        tokens = self.directory / "pki" / "tokens.csv"
        tokens.write_text(
            f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
            + "".join(f'{token},{user},{user},"system:nodes"\n' for user, token in self._node_tokens.items())
        )
        tokens.chmod(0o600)

    def _spawn(self, name: str, argv: list[str], node: Node | None = None) -> None:
        """Start daemon `name` (in `node`'s namespaces, for a node's daemon); its pid file records it."""
        detach = self._detach

        def prepare() -> None:
            if node is not None:
                node.enter()
            if not detach:
                _die_with_parent()

        with open(self.logs / f"{name}.log", "ab") as log_file:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                # The daemons find their helpers (runc, CNI's iptables, conntrack) in sbin; the
                # device plugin (`python -m tests.cluster.device_plugin`) its package here.
                env={
                    **os.environ,
                    "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                },
                # Own session: a Ctrl-C in the terminal does not kill them out of order.
                start_new_session=True,
                preexec_fn=None if detach and node is None else prepare,
                cwd=self.directory,
            )
        self._processes[name] = process
        (self.directory / f"{name}.pid").write_text(f"{process.pid}\n{argv[0]}\n")

    def _start_etcd(self, etcd: Path) -> str:
        client_url = f"http://127.0.0.1:{free_port()}"
        peer_url = f"http://127.0.0.1:{free_port()}"
        self._spawn("etcd", [
            str(etcd),
            "--name=default",
            f"--data-dir={self.directory / 'etcd-data'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--logger=zap",
            "--log-level=warn",
        ])  # fmt: skip
        return client_url

    def _start_apiserver(self, binaries: Binaries, etcd_url: str) -> None:
        port = free_port()
        pki = self.directory / "pki"
        address = self.host_ip or "127.0.0.1"
        argv = [
            str(binaries.kube_apiserver),
            f"--etcd-servers={etcd_url}",
            # With a node, pods reach the API server on the host's address.
            f"--bind-address={'0.0.0.0' if self.host_ip else '127.0.0.1'}",
            f"--advertise-address={address}",
            f"--secure-port={port}",
            f"--cert-dir={pki}",
            f"--tls-cert-file={self.ca_file}",
            f"--tls-private-key-file={self.key_file}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            # Node: what the kubelet may read (its pods' secrets, its own Node object).
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            # The certificate carries the public half; 1.20 cannot read it from a PKCS#8 EC key.
            f"--service-account-key-file={self.ca_file}",
            f"--service-account-signing-key-file={self.key_file}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            # With a node, the `kubernetes` Service's endpoints point at this server (pods use it);
            # without one nothing reads them.
            f"--endpoint-reconciler-type={'lease' if self.host_ip else 'none'}",
            # `kubectl logs` reaches the kubelet by the node's address, not its name.
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true",
            "--profiling=false",
        ]
        if _accepts_flag(binaries.kube_apiserver, "--insecure-port"):
            # Up to 1.23 an unauthenticated port 8080 opens by default and clashes between clusters.
            argv.append("--insecure-port=0")
        if binaries.kube_controller_manager is None:
            # Without the token controller no ServiceAccount gets a token, so Pods could not be
            # admitted by the ServiceAccount plugin.
            argv.append("--disable-admission-plugins=ServiceAccount")
        self._spawn("kube-apiserver", argv)
        server = f"https://{address}:{port}"
        write_kubeconfig(self.kubeconfig, server, self.ca_file, ADMIN_USER, self.admin_token)
        for node in self.nodes:
            node.directory.mkdir(parents=True, exist_ok=True)
            write_kubeconfig(node.kubeconfig, server, self.ca_file, node.user, self._node_tokens[node.user])

    def _start_controller_manager(self, binary: Path) -> None:
        argv = [
            str(binary),
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--controllers=*",
            f"--service-account-private-key-file={self.key_file}",
            f"--root-ca-file={self.ca_file}",
            # No serving port: nothing scrapes it, and the fixed default would clash between clusters.
            "--secure-port=0",
        ]
        if _accepts_flag(binary, "--port"):
            argv.append("--port=0")  # the insecure port, gone after 1.23
        self._spawn("kube-controller-manager", argv)

    def _wait_until(
        self,
        what: str,
        path: str,
        started: float,
        timeout: float,
        accept: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        """Poll GET `path` as admin until it answers 200 with a body `accept` likes, logging
        progress every second."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        # The kubeconfig's: a Cluster object of another process than the one that started it
        # (a fault from the command line) has no token of its own.
        config = json.loads(self.kubeconfig.read_text())
        server, token = config["clusters"][0]["cluster"]["server"], config["users"][0]["user"]["token"]
        request = urllib.request.Request(server + path, headers={"Authorization": f"Bearer {token}"})
        deadline = started + timeout
        last_report = time.monotonic()
        reason = "not serving yet"
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                # A short timeout: the port accepts connections seconds before TLS is served.
                with urllib.request.urlopen(request, context=context, timeout=0.5) as response:
                    if accept is None or accept(json.load(response)):
                        return
                    reason = "not yet"
            except urllib.error.HTTPError as error:
                body = error.read().decode(errors="replace")
                pending = [line[3:].split(" ")[0] for line in body.splitlines() if line.startswith("[-]")]
                reason = f"HTTP {error.code}" + (f", pending: {', '.join(pending)}" if pending else "")
            except OSError:  # refused, or TLS not served yet (URLError and timeouts are OSErrors)
                reason = "not serving yet"
            now = time.monotonic()
            if now - last_report >= 1.0:
                log.info("waiting for %s (%.1f s, %s)", what, now - started, reason)
                last_report = now
            time.sleep(0.1)
        raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what} ({reason})")

    def check_alive(self) -> None:
        """Raise, with its log tail, if a component this object started has exited."""
        for name, process in self._processes.items():
            if process.poll() is not None:
                raise ClusterError(f"{name} exited with status {process.returncode}; log tail:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            text = (self.logs / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # ---- state and stop ----------------------------------------------------------------------

    def _pid(self, name: str) -> tuple[int, str] | None:
        """The pid and argv[0] its pid file records."""
        try:
            pid, program = (self.directory / f"{name}.pid").read_text().splitlines()[:2]
            return int(pid), program
        except (OSError, ValueError):
            return None

    def _component_alive(self, name: str) -> bool:
        recorded = self._pid(name)
        if recorded is None:
            return False
        pid, program = recorded
        process = self._processes.get(name)
        if process is not None and process.pid == pid:
            return process.poll() is None  # also reaps it once it has exited
        return _pid_alive(pid, program)

    def _stop_order(self) -> list[tuple[str, Node | None]]:
        """Every daemon with its node: the scheduler, each node's kubelet and kube-proxy, the
        host's proxy and DNS, each node's containerd (its pods removed first), the control plane."""
        nodes = list(reversed(self.nodes))
        order: list[tuple[str, Node | None]] = [(HOST_DAEMONS[-1], None)]
        order += [(node.daemon(daemon), node) for node in nodes for daemon in reversed(NODE_DAEMONS[1:])]
        order += [(daemon, None) for daemon in reversed(HOST_DAEMONS[:-1])]
        order += [(node.daemon(NODE_DAEMONS[0]), node) for node in nodes]
        return order + [(daemon, None) for daemon in CONTROL_PLANE]

    def _component_dead(self, name: str) -> bool:
        return not self._component_alive(name)

    def running_components(self) -> list[str]:
        return [name for name, _ in self._stop_order() if self._component_alive(name)]

    def stop(self, timeout: float = 20.0) -> None:
        """Stop every component, the nodes first and the apiserver before etcd; SIGKILL what
        outlives `timeout`; then undo the nodes' changes to the host."""
        for name, node in self._stop_order():
            if node is not None and name == node.daemon("containerd"):
                node.remove_pods()
            recorded = self._pid(name)
            if recorded is not None and self._component_alive(name):
                self._terminate(name, recorded[0], timeout)
            (self.directory / f"{name}.pid").unlink(missing_ok=True)
        self._processes.clear()
        if self.nodes:
            self.node_host.cleanup_host()
        # etcd preallocates 64 MB of WAL; a stopped cluster's data is never reused. Logs stay.
        shutil.rmtree(self.directory / "etcd-data", ignore_errors=True)

    def _terminate(self, name: str, pid: int, timeout: float) -> None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._component_alive(name):
                return
            time.sleep(0.05)
        log.warning("%s (pid %d) ignored SIGTERM for %.0f s; killing it", name, pid, timeout)
        os.kill(pid, signal.SIGKILL)
        if name in self._processes:
            self._processes[name].wait()

    # ---- faults -------------------------------------------------------------------------------

    def partition(self, which: str | int) -> Node:
        """Cut the node off the network (every packet in and out dropped in its namespace:
        peers hear silence); everything on it keeps running."""
        node = self.node_named(which)
        node.cut()
        return node

    def power_off(self, which: str | int) -> Node:
        """The node's network cut first (so nothing it sends while dying gets out: peers hear
        silence, not resets), then its kubelet, kube-proxy, containerd, shims and every process of
        its pods SIGKILLed. Its pods stay as they are in the API (Running) until Kubernetes or the
        operator acts."""
        node = self.node_named(which)
        node.cut()
        for daemon in reversed(NODE_DAEMONS):
            name = node.daemon(daemon)
            recorded = self._pid(name)
            if recorded is not None and self._component_alive(name):
                os.kill(recorded[0], signal.SIGKILL)
                wait_for(f"{name} killed", functools.partial(self._component_dead, name), 10.0)
            process = self._processes.pop(name, None)
            if process is not None:
                process.wait()
            (self.directory / f"{name}.pid").unlink(missing_ok=True)
        node.kill_workloads()
        return node

    def powered_off(self, which: str | int) -> bool:
        node = self.node_named(which)
        return not any(self._component_alive(node.daemon(daemon)) for daemon in NODE_DAEMONS)

    def heal(self, which: str | int, *, detach: bool | None = None, timeout: float = 120.0) -> Node:
        """The node's network back; a powered-off node's containerd, kube-proxy and kubelet
        started again (detached from this process with `detach`, as `up` started them), and
        waited for until its Node reports Ready after the restart."""
        node = self.node_named(which)
        try:
            node.mend()
            if not self.powered_off(node.name):
                return node
            if detach is not None:
                self._detach = detach
            binaries = find_node_binaries()
            commands = node.commands(binaries, self.kubeconfig)
            restarted = time.time()
            started = time.monotonic()
            for daemon in NODE_DAEMONS:
                self._spawn(node.daemon(daemon), commands[daemon], node)
                if daemon == "containerd":
                    node.wait_for_runtime(self.check_alive)
        except NodeError as error:
            raise ClusterError(str(error)) from error
        self._wait_until(f"node {node.name} Ready again with its GPUs", f"/api/v1/nodes/{node.name}", started,
                         timeout, accept=lambda body: _node_ready_with_gpus(body, since=restarted))  # fmt: skip
        return node

    # ---- clients ------------------------------------------------------------------------------

    def shell_env(self) -> str:
        """What `eval "$(cluster.py up)"` sets: KUBECONFIG, and PATH with our kubectl first."""
        kubectl = find_node_binaries().kubectl
        return f'export KUBECONFIG={self.kubeconfig}\nexport PATH="{kubectl.parent}:$PATH"'

    def api_client(self) -> ApiClient:
        """A kubernetes.client.ApiClient acting as the admin user (system:masters)."""
        return api_client_for(self.kubeconfig)

    def require_controller_manager(self, purpose: str) -> None:
        if not self.has_controller_manager:
            raise ClusterError(
                f"{purpose} needs kube-controller-manager, which this cluster runs without: "
                "set TEST_ASSET_KUBE_CONTROLLER_MANAGER, or unset KUBEBUILDER_ASSETS to use the cached build"
            )

    def serviceaccount_kubeconfig(self, namespace: str, name: str, timeout: float = 60.0) -> Path:
        """A kubeconfig authenticating with the ServiceAccount's token (waits for its token secret)."""
        self.require_controller_manager(f"a token for ServiceAccount {namespace}/{name}")
        path = self.directory / f"serviceaccount-{namespace}-{name}.kubeconfig"
        return serviceaccount_kubeconfig(self.kubeconfig, namespace, name, path, timeout)

    def serviceaccount_api_client(self, namespace: str, name: str) -> ApiClient:
        """An ApiClient holding only that ServiceAccount's token: it gets exactly what RBAC grants."""
        return api_client_for(self.serviceaccount_kubeconfig(namespace, name))


def _node_ready(node: dict[str, Any], since: float | None = None) -> bool:
    """Whether the Node's Ready condition is True (and, with `since`, heard after that time)."""
    conditions = node.get("status", {}).get("conditions") or []
    return any(
        c["type"] == "Ready"
        and c["status"] == "True"
        and (since is None or _timestamp(c["lastHeartbeatTime"]) >= int(since))
        for c in conditions
    )


def _node_ready_with_gpus(node: dict[str, Any], since: float | None = None) -> bool:
    """Ready (heard after `since`), and its device plugin's GPUs allocatable: registered with the
    kubelet that runs now (a restarted kubelet shows none until the plugin registers again)."""
    allocatable = node.get("status", {}).get("allocatable") or {}
    return _node_ready(node, since) and allocatable.get(GPU_RESOURCE) == str(GPUS_PER_NODE)


def _timestamp(text: str) -> float:
    """An API timestamp (RFC 3339, UTC, whole seconds) as seconds since the epoch."""
    return calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ"))


def api_client_for(kubeconfig: Path) -> ApiClient:
    from kubernetes import config

    return config.new_client_from_config(config_file=str(kubeconfig))


def wait_for(what: str, probe: Callable[[], T | None], timeout: float) -> T:
    """Poll `probe` until it returns something truthy; ClusterError naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.2)
    raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")


def serviceaccount_kubeconfig(
    admin_kubeconfig: Path, namespace: str, name: str, path: Path, timeout: float = 60.0
) -> Path:
    """Write to `path` a kubeconfig that authenticates with the ServiceAccount's token secret.

    The token is the one kube-controller-manager's token controller puts in the ServiceAccount's
    secret, the same token a 1.20 Pod running as that ServiceAccount gets mounted.
    """
    import base64

    from kubernetes import client

    with api_client_for(admin_kubeconfig) as admin:
        core = client.CoreV1Api(admin)

        def token() -> str | None:
            account = core.read_namespaced_service_account(name, namespace)
            for reference in account.secrets or []:
                assert reference.name is not None
                secret = core.read_namespaced_secret(reference.name, namespace)
                data = secret.data or {}
                if secret.type == "kubernetes.io/service-account-token" and data.get("token"):
                    return base64.b64decode(data["token"]).decode()
            return None

        value = wait_for(f"a token secret for ServiceAccount {namespace}/{name}", token, timeout)
        server = admin.configuration.host
        ca_file = Path(admin.configuration.ssl_ca_cert)
    return write_kubeconfig(path, server, ca_file, f"system:serviceaccount:{namespace}:{name}", value)


FAULTS = ("power-off", "partition", "heal")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster.py", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "env", "binaries", *FAULTS])
    parser.add_argument("node", nargs="?", help="power-off, partition, heal: the node's name or number")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="cluster folder (default: .cluster)")
    parser.add_argument("--nodes", type=int, default=1, choices=range(MAX_NODES + 1),
                        help=f"`up`: real nodes to start, 0 to {MAX_NODES} (default 1)")  # fmt: skip
    args = parser.parse_args(argv)
    if (args.command in FAULTS) != (args.node is not None):
        parser.error(f"a node is named by {', '.join(FAULTS)} and only by them")
    logging.basicConfig(level=logging.INFO, format="cluster: %(message)s")
    cluster = Cluster(args.dir)
    try:
        if args.command == "binaries":
            binaries = find_binaries()
            for field, path in vars(binaries).items():
                print(f"{field}: {path if path is not None else '(none)'}")
        elif args.command == "up":
            running = cluster.running_components()
            if {"etcd", "kube-apiserver"} <= set(running):
                log.info("already running (%s)", ", ".join(running))
            else:
                cluster.stop()  # whatever survived of a broken earlier cluster
                cluster.start(find_binaries(), detach=True, nodes=args.nodes)
            print(cluster.shell_env())
        elif args.command == "down":
            cluster.stop()
            cluster.kubeconfig.unlink(missing_ok=True)
            log.info("stopped")
        elif args.command == "env":
            if not cluster.running_components():
                raise ClusterError(f"no cluster runs in {cluster.directory}; run `make cluster`")
            print(cluster.shell_env())
        elif args.command == "power-off":
            log.info("%s powered off", cluster.power_off(args.node).name)
        elif args.command == "partition":
            log.info("%s cut off the network", cluster.partition(args.node).name)
        else:
            log.info("%s healed", cluster.heal(args.node, detach=True).name)
    except (ClusterError, NodeError) as error:
        log.error("%s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
