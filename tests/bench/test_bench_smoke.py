"""The worker benches (collectives, failover, recovery, stores, serving, heartbeats) run end to end with
their smallest settings (--quick) and report their figures in the documented JSON shape. Their
speed targets are the benches' business: no timing is asserted here, only that every figure is a
finite positive number (a count of errors, or a time spent below a floor, may be zero)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Timings, under loads of the benches' own making only: after `make test`'s background builds.
pytestmark = pytest.mark.quiet

# Each bench runs as `python -m bench.NAME` from the repository root.
REPO = Path(__file__).resolve().parents[2]
# Several processes importing torch on two shared cores, then the measurements.
RUN_S = 600
# A line that tells of a failure: an exception, a failed world or join, a traceback.
FAILURE = re.compile(r"Traceback|Error\b|\bfailed\b|FAILED")


def excerpt(output: str, tail: int = 3000, lines: int = 30) -> str:
    """A failed run's output in short: the lines from the first one that tells of a failure
    (the first cause; what follows often only results from it), then the last `tail` characters."""
    split = output.splitlines()
    first = next((i for i, line in enumerate(split) if FAILURE.search(line)), None)
    head = "\n".join(split[first : first + lines])[:tail] if first is not None else ""
    return output[-tail:] if head in output[-tail:] else f"{head}\n[...]\n{output[-tail:]}"


def run_bench(name: str, *flags: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--quick", "--json", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_S,
        check=False,
    )
    assert result.returncode == 0, excerpt(result.stdout) + excerpt(result.stderr)
    lines = result.stdout.strip().splitlines()
    # The readable report comes first, with a verdict per target; the JSON line is the last.
    assert any(line.startswith(("  PASS", "  MISS")) for line in lines[:-1]), result.stdout
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict), lines[-1]
    return figures


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def error_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def spread(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"min", "median", "max"}
        and all(positive(v) for v in value.values())
        and value["min"] <= value["median"] <= value["max"]
    )


@pytest.mark.timeout(RUN_S + 60)
def test_collectives_reports_a_ratio_per_op_and_size() -> None:
    figures = run_bench("collectives")
    assert set(figures) == {"collectives"}
    assert set(figures["collectives"]) == {"ratios", "standard_errors"}
    ratios = figures["collectives"]["ratios"]
    errors = figures["collectives"]["standard_errors"]
    # A standard error per ratio: how far a cell's ratio may be from the truth.
    assert {op: set(by_size) for op, by_size in errors.items()} == {op: set(by_size) for op, by_size in ratios.items()}
    assert all(0 <= e < 1 for by_size in errors.values() for e in by_size.values()), errors
    assert set(ratios) == {"all_reduce", "all_reduce_async", "all_gather", "broadcast", "send_recv"}
    for op, by_size in ratios.items():
        assert by_size, op
        assert all(size.isdigit() and int(size) > 0 for size in by_size), (op, by_size)
        assert all(positive(r) for r in by_size.values()), (op, by_size)
    # Every op is measured at the same sizes.
    assert len({tuple(sorted(by_size)) for by_size in ratios.values()}) == 1, ratios


@pytest.mark.timeout(RUN_S + 60)
def test_failover_reports_detection_and_false_verdicts_with_and_without_load() -> None:
    figures = run_bench("failover")
    assert set(figures) == {"failover"}
    failover = figures["failover"]
    assert set(failover) == {"settings", "other_world_errors", "phases"}
    assert set(failover["settings"]) == {"heartbeat_interval", "dead_after"}
    assert all(positive(v) for v in failover["settings"].values()), failover["settings"]
    assert error_count(failover["other_world_errors"]), failover
    # A baseline, and the same with the bench's own busy processes (2 with --quick).
    assert set(failover["phases"]) == {"baseline", "loaded"}, failover["phases"]
    for name, phase in failover["phases"].items():
        keys = {"load", "load_cores", "detect_s", "soak", "false_verdicts_in_trials", "other_world"}
        assert set(phase) == keys, phase
        assert phase["load"] == (0 if name == "baseline" else 2), phase
        assert phase["load_cores"] >= 0 and error_count(phase["false_verdicts_in_trials"]), phase
        assert set(phase["detect_s"]) == {"crash_busy", "crash_idle", "frozen", "frozen_host", "store_host"}
        assert all(spread(v) for v in phase["detect_s"].values()), phase["detect_s"]
        soak = phase["soak"]
        counts = {"false_verdicts", "false_verdicts_joining", "late_readings", "called_off"}
        assert set(soak) == counts | {"seconds", "worlds", "longest_silence_s"}, soak
        assert positive(soak["seconds"]) and soak["worlds"] == 7, soak
        assert all(error_count(soak[c]) for c in counts) and positive(soak["longest_silence_s"]), soak
        assert positive(phase["other_world"]["worst_gap_ratio"]), phase


@pytest.mark.timeout(RUN_S + 60)
def test_recovery_reports_recovery_import_time_and_the_unaffected_world() -> None:
    figures = run_bench("recovery")
    assert set(figures) == {"recovery_s", "torch_import_s", "unaffected"}
    assert spread(figures["recovery_s"]), figures
    assert positive(figures["torch_import_s"]), figures
    unaffected = figures["unaffected"]
    assert set(unaffected) == {"worst_gap_ratio", "errors"}
    assert positive(unaffected["worst_gap_ratio"]) and error_count(unaffected["errors"]), unaffected


@pytest.mark.timeout(RUN_S + 60)
def test_stores_reports_formation_and_requests_for_ours_and_torchs() -> None:
    figures = run_bench("stores")
    assert set(figures) == {"size", "formation_s", "requests", "targets"}
    assert figures["size"] == 4, figures
    assert set(figures["formation_s"]) == set(figures["requests"]) == {"torch", "ours"}, figures
    assert all(spread(v) for v in figures["formation_s"].values()), figures["formation_s"]
    calls = {"per_s", "add_median_s", "add_p99_s", "multi_get_median_s", "multi_get_p99_s"}
    for kind, asked in figures["requests"].items():
        assert set(asked) == calls and all(positive(v) for v in asked.values()), (kind, asked)
    assert all(positive(t["value"]) for t in figures["targets"].values()), figures["targets"]


@pytest.mark.timeout(RUN_S + 60)
def test_serving_reports_throughput_losses_and_latency_through_failures() -> None:
    figures = run_bench("serving")
    assert set(figures) == {"steady_rps", "lost", "duplicates", "p99_ms", "dip_s"}
    assert positive(figures["steady_rps"]), figures
    assert error_count(figures["lost"]) and error_count(figures["duplicates"]), figures
    assert set(figures["p99_ms"]) == {"steady", "during_failure"}
    assert all(positive(v) for v in figures["p99_ms"].values()), figures
    dip = figures["dip_s"]
    assert isinstance(dip, (int, float)) and math.isfinite(dip) and dip >= 0, figures


@pytest.mark.timeout(RUN_S + 60)
def test_serving_reports_losses_latency_and_dips_through_a_rollout() -> None:
    figures = run_bench("serving", "--rollout")
    assert set(figures) == {"steady_rps", "lost", "duplicates", "p99_ms", "dip_s", "rollout"}
    assert positive(figures["steady_rps"]), figures
    assert error_count(figures["lost"]) and error_count(figures["duplicates"]), figures
    assert set(figures["p99_ms"]) == {"steady", "during_rollout"}
    assert all(positive(v) for v in figures["p99_ms"].values()), figures
    rollout = figures["rollout"]
    keys = {"replaced", "window_s", "complete", "during_rps", "window_dip_s", "restarts", "per_replica"}
    assert set(rollout) == keys, rollout
    # Whether every replica was replaced and back before the stream ended is the bench's target
    # (a slow start of the new template's spares may miss it): here, that the rollout began.
    assert positive(rollout["replaced"]) and isinstance(rollout["complete"], bool), rollout
    assert positive(rollout["window_s"]) and positive(rollout["during_rps"]), rollout
    assert error_count(rollout["restarts"]), rollout
    assert len(rollout["per_replica"]) == rollout["replaced"], rollout
    assert all(r["replica"] in (1, 2) for r in rollout["per_replica"]), rollout
    dips = [figures["dip_s"], rollout["window_dip_s"], *(r["dip_s"] for r in rollout["per_replica"])]
    assert all(isinstance(d, (int, float)) and math.isfinite(d) and d >= 0 for d in dips), figures
    assert all(r["back_s"] is None or positive(r["back_s"]) for r in rollout["per_replica"]), rollout


@pytest.mark.timeout(RUN_S + 60)
def test_heartbeats_reports_requests_per_interval_and_the_cost_of_shared_worlds() -> None:
    figures = run_bench("heartbeats")
    assert set(figures) == {"heartbeats"}
    heartbeats = figures["heartbeats"]
    assert set(heartbeats) == {"requests_per_interval", "shared_worlds", "per_world"}
    for ranks, stores in heartbeats["requests_per_interval"].items():
        assert ranks.isdigit() and set(stores) == {"beat_store", "world_store"}, stores
        assert all(positive(v) for v in stores["beat_store"].values()), stores
        # A world's own store is asked now and then: maybe not within the short window.
        assert all(v >= 0 for v in stores["world_store"].values()), stores
    for worlds, shared in heartbeats["shared_worlds"].items():
        assert worlds.isdigit() and set(shared) == {"idle_cpu_pct", "threads", "rss_mib", "detect_s"}, shared
        assert set(shared["detect_s"]) == {"peer_frozen", "host_frozen"}
        assert all(positive(v) for v in shared["detect_s"].values()), shared
        for what in ("threads", "rss_mib"):
            assert set(shared[what]) == {"host", "member"} and all(positive(v) for v in shared[what].values()), shared
        # An idle process may use less than one clock tick of CPU in the short window.
        assert all(v >= 0 for v in shared["idle_cpu_pct"].values()), shared
    per_world = heartbeats["per_world"]
    assert all(positive(v) for v in per_world["threads"].values()), per_world
    # Memory per world is a difference of RSS readings: noise at the few worlds of --quick.
    assert all(math.isfinite(v) for v in per_world["rss_mib"].values()), per_world


@pytest.mark.timeout(RUN_S + 60)
def test_journeys_reports_the_start_and_the_settle_of_each_drawn_journey() -> None:
    figures = run_bench("journeys")
    assert set(figures) == {"journeys", "start_s", "settle_s"}
    assert figures["journeys"] == 1
    assert spread(figures["start_s"]), figures
    # Settled at the last change of state: a fault that moved nothing settles at once.
    assert all(math.isfinite(v) and v >= 0 for v in figures["settle_s"].values()), figures
