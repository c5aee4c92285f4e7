"""bench/operator_failures.py, bench/scale.py, bench/takeover.py and bench/attacks.py run end to end (--quick) against
their own API server and report their figures in the documented JSON shape. Their speed targets
are the benches' business: no timing is asserted here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kube

# Each bench runs as `python -m bench.NAME` from the repository root.
REPO = Path(__file__).resolve().parents[2]
BENCH = "bench.operator_failures"
# A control plane, the chart, and MultiWorlds of up to 128 worlds on two shared cores.
RUN_S = 900


def run_quick(bench: str) -> subprocess.CompletedProcess[str]:
    """`python -m BENCH --quick --json` from the repository root."""
    argv = [sys.executable, "-m", bench, "--quick", "--json"]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=RUN_S, check=False)


@pytest.mark.timeout(RUN_S + 60)
def test_quick_run_reports_react_and_writes_per_failure() -> None:
    result = run_quick(BENCH)
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


SCALE = "bench.scale"


@pytest.mark.timeout(RUN_S + 60)
def test_scale_quick_run_reports_every_figure() -> None:
    result = run_quick(SCALE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(figures) == {
        "react_s",
        "object_kib",
        "worker_watch_kib_per_failure",
        "create_s",
        "operator_rss_mib",
        "many",
        "largest",
    }
    largest = figures["largest"]
    assert 0 < largest["plan_first"]["wall_s"] < 10 and largest["operator_rss_mib"] > 0, largest
    assert set(figures["react_s"]) == set(figures["create_s"]) == {"2", "10"}
    assert set(figures["object_kib"]) == {"2", "10", "20"}
    assert figures["object_kib"]["2"] < figures["object_kib"]["10"] < figures["object_kib"]["20"]
    assert all(
        v > 0
        for v in [
            *figures["react_s"].values(),
            *figures["create_s"].values(),
            *figures["operator_rss_mib"].values(),
            figures["many"]["react_s"],
        ]
    )
    # An unaffected worker's channel: nothing, or a few bookmarks, whatever the size.
    assert all(0 <= v < 4 for v in figures["worker_watch_kib_per_failure"].values()), figures


TAKEOVER = "bench.takeover"


@pytest.mark.timeout(RUN_S + 60)
def test_takeover_quick_run_reports_both_takeovers() -> None:
    result = run_quick(TAKEOVER)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert set(figures) == {"lease_duration_s", "takeover_s", "first_react_s"}
    for figure in ("takeover_s", "first_react_s"):
        assert set(figures[figure]) == {"graceful", "killed"}
        for spread in figures[figure].values():
            assert set(spread) == {"min", "median", "max"}
            assert 0 < spread["min"] <= spread["median"] <= spread["max"], figures
    assert any(line.startswith(("  PASS", "  MISS")) for line in lines[:-1]), result.stdout


ATTACKS = "bench.attacks"


@pytest.mark.timeout(RUN_S + 60)
def test_attacks_quick_run_reports_each_phase() -> None:
    result = run_quick(ATTACKS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert set(figures) == {"bench", "react_s", "operator_rss_mib", "junk_connections", "flood_connections"}
    phases = {"baseline", "channel_junk", "port_flood", "memory"}
    assert set(figures["react_s"]) == set(figures["operator_rss_mib"]) == phases
    assert all(v > 0 for times in figures["react_s"].values() for v in times), figures
    assert figures["junk_connections"] > 0 and figures["flood_connections"] > 0
    assert any(line.startswith(("  PASS", "  MISS")) for line in lines[:-1]), result.stdout
