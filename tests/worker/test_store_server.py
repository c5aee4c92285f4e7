"""A store this library serves answers its clients while peers connect, however slow the
resolver (store/server.py): torch's own server looks each new connection up in DNS on the thread
that answers every client. Each case runs in a network namespace whose only nameserver answers
after SLOW_ANSWER_S (tests.support.slow_nameserver)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.worker_support import REPO

SLOW_ANSWER_S = 1.5
NAMESERVER = "127.0.0.53"

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")


def worst_adds_while_peers_connect(*modes: str) -> dict[str, float]:
    """tests.worker.store_answers_program's figures for `modes`, run beside a slow nameserver."""
    with tempfile.TemporaryDirectory() as tmp:
        resolv = Path(tmp, "resolv.conf")
        resolv.write_text(f"nameserver {NAMESERVER}\n")
        python = sys.executable
        script = (
            "set -e; ip link set lo up; "
            f"mount --bind {resolv} /etc/resolv.conf; "
            f"{python} -m tests.support.slow_nameserver {NAMESERVER} {SLOW_ANSWER_S} > {tmp}/ns 2>&1 & ns=$!; "
            f"until [ -s {tmp}/ns ]; do sleep 0.05; done; "
            f"rc=0; {python} -m tests.worker.store_answers_program {' '.join(modes)} || rc=$?; "
            'kill "$ns"; exit "$rc"'
        )
        done = subprocess.run(
            ["unshare", "--mount", "--net", "--", "sh", "-c", script],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_slow_resolver_holds_torchs_own_store_server_but_not_ours() -> None:
    worst = worst_adds_while_peers_connect("torch", "ours")
    # The premise, so that "ours" cannot pass by a resolver that answers at once: torch's own
    # server stops answering while it looks a loopback peer up.
    assert worst["torch"] >= SLOW_ANSWER_S * 0.9, worst
    assert worst["ours"] < 0.5, worst


def test_a_store_listens_on_the_family_its_members_reach_it_by() -> None:
    from multiworld.store.server import listen_family

    assert listen_family("127.0.0.1") == socket.AF_INET
    assert listen_family("10.1.2.3") == socket.AF_INET
    assert listen_family("::1") == socket.AF_INET6
    assert listen_family("fd00::5") == socket.AF_INET6
