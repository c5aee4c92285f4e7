"""`make demo`, exactly as the README's Quickstart runs it: the seed topology with a worker of
world1 killed, and a summary that shows world1 recovered and world2 untouched."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_make_demo_recovers_world1_and_leaves_world2_alone() -> None:
    result = subprocess.run(["make", "-s", "demo"], cwd=REPO, capture_output=True, text=True, timeout=360)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    summary = out[out.rindex("summary:") :]
    world1 = re.search(
        r"world1: Running at epoch 2; failures 1, recoveries 1 \((\d+\.\d+)s\), planned changes 0, errors (\d+)",
        summary,
    )
    assert world1, summary
    assert re.search(
        r"world2: Running at epoch 1; failures 0, recoveries 0 \(-\), planned changes 0, errors 0", summary
    ), summary
    assert "orphan processes: 0" in summary, summary
    assert "injecting failure: SIGKILL all-gather-w1-1" in out, out
    # However long the members took to start, the run ends once world1 is back.
    assert "every fault is recovered from: ending the run (--until-recovered)" in out, out
