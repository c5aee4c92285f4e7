"""What the test nodes do to this machine, in small steps: commands, processes, namespaces,
mounts, cgroups, iptables rules and sysctls (node.py and nodes.py build nodes from them, and
undo them on cleanup). Standard library only."""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import socket
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

CHAIN_PREFIXES = ("KUBE-", "CNI-")
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000


class NodeError(RuntimeError):
    """A node could not be started, changed or stopped; the message says why."""


def run(argv: list[str], what: str, preexec: Callable[[], None] | None = None) -> str:
    """Run `argv` (in the namespaces `preexec` enters); NodeError with its output if it fails."""
    result = subprocess.run(argv, capture_output=True, text=True, check=False, preexec_fn=preexec)
    if result.returncode != 0:
        raise NodeError(f"{what} failed ({shlex.join(argv)}): {(result.stderr or result.stdout).strip()[-2000:]}")
    return result.stdout


def enter_namespaces(network: Path, mounts: Path | None) -> None:
    """Join a network namespace and a mount namespace by their files (in a child before exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for path, kind in ((network, CLONE_NEWNET), (mounts, CLONE_NEWNS)):
        if path is None:
            continue
        descriptor = os.open(path, os.O_RDONLY)
        try:
            if libc.setns(descriptor, kind) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"setns {path}: {os.strerror(error)}")
        finally:
            os.close(descriptor)


def read_sysctl(key: str) -> str | None:
    try:
        return Path("/proc/sys", *key.split(".")).read_text().strip()
    except OSError:
        return None


def write_sysctl(key: str, value: str) -> None:
    Path("/proc/sys", *key.split(".")).write_text(value + "\n")


def processes() -> dict[int, tuple[int, list[str]]]:
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


def listening(unix_socket: Path) -> bool:
    """Whether a process serves `unix_socket`: a killed node (its machine snapshotted, its
    session cut off) leaves the file behind, which must not block the next node."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(unix_socket))
        except OSError:
            return False
    return True


def shims(containerd_socket: Path) -> list[int]:
    """The containerd shims serving a containerd (they outlive it by design)."""
    return [
        pid for pid, (_, argv) in processes().items()
        if argv and Path(argv[0]).name.startswith("containerd-shim") and str(containerd_socket) in argv
    ]  # fmt: skip


def kill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_tree(root: int) -> None:
    found = processes()
    doomed, frontier = [root], [root]
    while frontier:
        children = [pid for pid, (parent, _) in found.items() if parent in frontier]
        doomed += children
        frontier = children
    kill(doomed)


def mount_points_under(folders: Iterable[Path]) -> list[str]:
    prefixes = [str(folder.resolve()) if folder.exists() else str(folder) for folder in folders]
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if any(point == prefix or point.startswith(prefix + "/") for prefix in prefixes):
            points.append(point)
    return points


def unmount_under(folders: Iterable[Path]) -> None:
    folders = list(folders)
    for _ in range(3):  # a lazy unmount can reveal a mount below it
        points = mount_points_under(folders)
        if not points:
            return
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def remove_rules(tool: str, comment: str) -> None:
    """Remove the rules tagged `comment` and every KUBE-*/CNI-* chain with the rules that jump to it."""
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
            if own and (target.startswith(CHAIN_PREFIXES) or comment in words):
                subprocess.run([tool, "-w", "-t", table, "-D", *words[1:]], capture_output=True, check=False)
    for action in ("-F", "-X"):
        for table, chain in chains:
            subprocess.run([tool, "-w", "-t", table, action, chain], capture_output=True, check=False)


def cgroup_hierarchies() -> list[Path]:
    """Each mounted cgroup hierarchy's root: every controller's on cgroup v1, the one on v2."""
    top = Path("/sys/fs/cgroup")
    if (top / "cgroup.procs").exists():
        return [top]
    return [hierarchy for hierarchy in top.iterdir() if (hierarchy / "cgroup.procs").exists()]


def make_cgroup(name: str) -> None:
    """/<name> in every hierarchy (a kubelet's cgroupRoot must exist), cpuset filled from its parent."""
    for hierarchy in cgroup_hierarchies():
        folder = hierarchy / name
        folder.mkdir(exist_ok=True)
        for key in ("cpuset.cpus", "cpuset.mems"):
            if (folder / key).exists() and not (folder / key).read_text().strip():
                (folder / key).write_text((hierarchy / key).read_text())


def cgroup_pids(name: str) -> set[int]:
    """Every process in /<name> or below it, in any hierarchy."""
    found: set[int] = set()
    for hierarchy in cgroup_hierarchies():
        top = hierarchy / name
        if not top.is_dir():
            continue
        # os.walk passes over a cgroup removed while it looks (a pod ending); rglob would raise.
        for folder, _, files in os.walk(top):
            if "cgroup.procs" not in files:
                continue
            try:
                found.update(int(pid) for pid in (Path(folder) / "cgroup.procs").read_text().split())
            except OSError:
                continue
    return found


def remove_cgroup(name: str) -> None:
    """/<name> and every cgroup below it (empty once their processes are killed), deepest first."""
    for hierarchy in cgroup_hierarchies():
        top = hierarchy / name
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
