"""An example program in several worlds under `multiworld run`: each world it is in runs as soon
as that world forms, whatever its other worlds do.

Chain a - b - c: a is in world x, b in x and y, c in y. c's pod never joins y (its program
only sleeps), so y never forms; x must run all the same. A program that waited for all its
worlds before driving any (init_from_env's default wait) left b out of x, and a's every op in
x waited out the op timeout.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
# Only turns a hang into a failure: x runs seconds after its two processes start.
X_RUNS_WITHIN = 120.0


def chain_manifest(tmp_path: Path) -> tuple[Path, str]:
    name = f"shared-{zlib.crc32(str(tmp_path).encode()):08x}"
    container = {
        "name": "worker",
        "image": "ghcr.io/multiworld/worker:0.1.0",
        "command": ["python", "examples/all_gather/main.py"],
        "args": ["--steps", "100000", "--interval", "0.1"],
    }
    idle = {**container, "command": ["python", "-c", "import time; time.sleep(3600)"], "args": []}
    doc = {
        "apiVersion": "multiworld.io/v1alpha1",
        "kind": "MultiWorld",
        "metadata": {"name": name},
        "spec": {
            "template": {"spec": {"containers": [container]}},
            "members": [{"name": "a"}, {"name": "b"}, {"name": "c", "template": {"spec": {"containers": [idle]}}}],
            "worlds": [{"name": "x", "ranks": ["a", "b"]}, {"name": "y", "ranks": ["b", "c"]}],
        },
    }
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, name


def test_a_shared_member_runs_the_world_that_formed_while_its_other_world_waits(tmp_path: Path) -> None:
    path, name = chain_manifest(tmp_path)
    logs = tmp_path / "logs"
    runner = subprocess.Popen(
        [sys.executable, "-m", "multiworld_operator.cli", "run", str(path), "--json", "--no-view",
         "--log-dir", str(logs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    a_log, b_log = logs / f"{name}-a-0.log", logs / f"{name}-b-0.log"
    try:
        deadline = time.monotonic() + X_RUNS_WITHIN
        while not (a_log.is_file() and "from x has gathered tensors" in a_log.read_text()):
            if time.monotonic() > deadline or runner.poll() is not None:
                break
            time.sleep(0.5)
        runner.send_signal(signal.SIGINT)
        out, err = runner.communicate(timeout=60)
    finally:
        runner.kill()
    summary = json.loads(out.strip().splitlines()[-1])
    a_text = a_log.read_text() if a_log.is_file() else ""
    b_text = b_log.read_text() if b_log.is_file() else ""
    assert "from x has gathered tensors" in a_text, (a_text[-2000:], b_text[-2000:], err[-3000:])
    assert "rank: 1 from x has gathered tensors" in b_text, b_text[-2000:]
    assert summary["worlds"]["x"]["failures"] == 0, summary
    assert summary["worlds"]["y"]["phase"] != "Running", summary
