"""`multiworld status`, run as a user runs it (the installed command, the admin's kubeconfig),
against MultiWorlds the operator serves on the real API server: one MultiWorld's worlds, the
namespace's list, `--watch` following a failure, and the errors a user can meet."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.operator_support import Scene, two_worlds, wait_for

pytestmark = pytest.mark.kube

COMMAND = str(Path(sys.executable).with_name("multiworld"))
TIMEOUT_S = 60


def status(scene: Scene, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [COMMAND, "status", *args, "--kubeconfig", str(scene.cluster.kubeconfig)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def cells(output: str, first: str) -> list[str]:
    """The cells of the line that starts with `first` (a table row)."""
    (line,) = [line for line in output.splitlines() if line.split()[:1] == [first]]
    return line.split()


def test_status_shows_each_world_and_its_last_failure(scene: Scene) -> None:
    kube = scene.kube
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})
    scene.kubelet.fail("mw-a-0")
    kube.wait_running(epochs={"wa": 2, "wb": 1})

    shown = status(scene, "mw", "-n", kube.namespace)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert out.splitlines()[0].startswith(f"{kube.namespace}/mw: Running, worlds running 2/2, restarts 1"), out
    assert cells(out, "WORLD") == ["WORLD", "PHASE", "EPOCH", "RANKS", "UP", "RESTARTS", "LAST", "FAILURE"]
    assert cells(out, "wa")[:7] == ["wa", "Running", "2", "3/3", "1", "PodFailed", "mw-a-0"], out
    assert cells(out, "wb") == ["wb", "Running", "1", "3/3", "0"], out
    assert "Ready=True" in out and "Degraded=False" in out

    listed = status(scene, "-n", kube.namespace)
    assert listed.returncode == 0, listed.stderr
    assert cells(listed.stdout, "mw")[:5] == ["mw", "Running", "2/2", "1", "5/5"], listed.stdout


def test_watch_shows_the_failure_and_ends_when_the_multiworld_is_deleted(scene: Scene) -> None:
    kube = scene.kube
    kube.create(two_worlds())
    kube.wait_running(epochs={"wa": 1, "wb": 1})
    watcher = subprocess.Popen(
        [COMMAND, "status", "mw", "-n", kube.namespace, "--watch", "--kubeconfig", str(scene.cluster.kubeconfig)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    assert watcher.stdout is not None
    stdout = watcher.stdout

    def read() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []

    def shown(text: str) -> bool:
        while not lines.empty():
            seen.append(lines.get())
        return any(text in line for line in seen)

    try:
        wait_for("the first block", lambda: shown("wa "))
        scene.kubelet.fail("mw-b-1")
        wait_for("wb's failure, shown by the watch", lambda: shown("PodFailed mw-b-1"))
        kube.delete()
        assert watcher.wait(TIMEOUT_S) == 1
        assert "deleted" in (watcher.stderr.read() if watcher.stderr else "")
    finally:
        watcher.kill()
        watcher.wait()
    assert sum(line.startswith("--- ") for line in seen) >= 2, seen


def test_a_missing_multiworld_or_namespace_is_one_clear_line(scene: Scene) -> None:
    missing = status(scene, "nope", "-n", scene.kube.namespace)
    assert missing.returncode == 1
    assert missing.stderr.strip() == f"multiworld status: multiworld {scene.kube.namespace}/nope: not found"
    empty = status(scene, "-n", "no-such-namespace")
    assert empty.returncode == 0 and empty.stdout.strip() == "no MultiWorlds in namespace no-such-namespace"


def test_no_cluster_credentials_say_which_kubeconfig_was_read_and_what_is_needed(tmp_path: Path) -> None:
    """A new user with no cluster: one line naming the kubeconfig read and what the command needs."""
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "missing"), "KUBERNETES_SERVICE_HOST": ""}
    result = subprocess.run([COMMAND, "status"], capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(
        f"multiworld status: no cluster credentials in KUBECONFIG={tmp_path / 'missing'} (no such file): "
    ), result.stderr
    assert "point --kubeconfig or KUBECONFIG at one" in result.stderr and "multiworld run" in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_an_unreachable_api_server_is_one_clear_line(tmp_path: Path) -> None:
    """A kubeconfig whose server does not answer (a cluster that is down): no traceback, no retries."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    result = subprocess.run(
        [COMMAND, "status", "--kubeconfig", str(kubeconfig)], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(
        f"multiworld status: cannot reach the API server at https://127.0.0.1:1 (from {kubeconfig}): "
    ), result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
