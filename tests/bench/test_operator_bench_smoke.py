"""bench/operator.py runs end to end (--quick) against its own API server and reports its
figures in the documented JSON shape. Its speed targets are the bench's business: no timing
is asserted here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kube

BENCH = Path(__file__).resolve().parents[2] / "bench" / "operator.py"
# A control plane, the chart, and MultiWorlds of up to 128 worlds on two shared cores.
RUN_S = 900


@pytest.mark.timeout(RUN_S + 60)
def test_quick_run_reports_react_and_writes_per_failure() -> None:
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--json"], capture_output=True, text=True,
                            timeout=RUN_S, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    figures = json.loads(lines[-1])

    assert set(figures) == {"react_s", "writes_per_failure"}
    assert set(figures["react_s"]) == {"median", "p99"}
    assert set(figures["writes_per_failure"]) == {"2", "16", "128"}
    values = [*figures["react_s"].values(), *figures["writes_per_failure"].values()]
    assert all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values), figures
    assert figures["react_s"]["median"] <= figures["react_s"]["p99"]
    # The readable report comes first, with a verdict per target.
    assert any(line.startswith(("  PASS", "  MISS")) for line in lines[:-1]), result.stdout
