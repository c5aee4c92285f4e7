"""The worker's own Prometheus metrics (multiworld.metrics): served on MULTIWORLD_METRICS_PORT by
real member processes over gloo, scraped over HTTP; nothing of prometheus_client without it; a
bad port refused when the worker starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from multiworld.contract import ENV_METRICS_PORT, WorkerEnv
from tests.support.worker_support import TEST_DETECT, Member, assignment, free_ports, static_env

METRICS_MEMBER = Path(__file__).with_name("metrics_member.py")
DETECT_ENV = {f"MULTIWORLD_{name.upper()}": str(seconds) for name, seconds in TEST_DETECT.items()}
BROKEN_WITHIN_S = 30.0
OPS = "multiworld_worker_ops_total"
DURATION = "multiworld_worker_op_duration_seconds"
JOINS = "multiworld_worker_joins_total"
BREAKS = "multiworld_worker_breaks_total"


def start_pair(spawn: Callable[..., Member], metrics_ports: list[int] | None) -> list[Member]:
    """Both ranks of world `w` running metrics_member.py, each serving its metrics on its port of
    `metrics_ports` (None: the variable unset)."""
    store_port = free_ports(1)[0]
    members = []
    for rank in range(2):
        env = {**static_env(f"p{rank}", [assignment("w", rank, 2, store_port)]), **DETECT_ENV}
        if metrics_ports is not None:
            env[ENV_METRICS_PORT] = str(metrics_ports[rank])
        members.append(spawn(f"p{rank}", {}, env, [str(METRICS_MEMBER)]))
    return members


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """The samples a worker serves, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset({"world": "w", **labels}.items())))


def test_a_worker_counts_its_ops_joins_breaks_and_missed_heartbeats(spawn) -> None:
    ports = free_ports(2)
    members = start_pair(spawn, ports)
    for member in members:
        assert member.wait_for("ops_done")["prometheus_loaded"] is True

    ops_per_rank = [{"all_reduce": 3, "broadcast": 2, "send": 1}, {"all_reduce": 3, "broadcast": 2, "recv": 1}]
    for port, ops in zip(ports, ops_per_rank, strict=True):
        samples = scrape(port)
        issued = {dict(labels)["op"]: value for (name, labels), value in samples.items() if name == OPS}
        assert issued == ops
        for op, n in ops.items():
            assert sample(samples, f"{DURATION}_count", op=op) == n
            assert sample(samples, f"{DURATION}_bucket", op=op, le="+Inf") == n
        assert sample(samples, JOINS) == 1
        assert sample(samples, BREAKS) is None

    # Rank 1 dies with no op in flight: rank 0, the world's host, sees its heartbeat stop.
    members[1].signal(signal.SIGKILL)
    deadline = time.monotonic() + BROKEN_WITHIN_S
    while sample(samples := scrape(ports[0]), BREAKS) != 1:
        assert time.monotonic() < deadline, f"no break counted within {BROKEN_WITHIN_S}s: {samples}"
        time.sleep(0.2)
    misses = sample(samples, "multiworld_worker_heartbeat_misses_total")
    assert misses is not None and misses >= 1
    assert (sample(samples, OPS, op="all_reduce"), sample(samples, JOINS)) == (3, 1)
    members[0].tell("stop")
    assert members[0].wait_exit() == 0, members[0].stderr()


def test_without_the_variable_a_worker_never_loads_prometheus_client(spawn) -> None:
    members = start_pair(spawn, None)
    for member in members:
        assert member.wait_for("ops_done")["prometheus_loaded"] is False
    for member in members:
        member.tell("stop")
    for member in members:
        assert member.wait_exit() == 0, member.stderr()


@pytest.mark.parametrize("value", ["abc", "0", "-1", "65536", "9100.0"])
def test_a_bad_metrics_port_is_refused_naming_the_variable(value: str) -> None:
    env = {**WorkerEnv(pod="p").to_env(), ENV_METRICS_PORT: value}
    with pytest.raises(ValueError, match=f"{ENV_METRICS_PORT}={value!r} is not a port"):
        WorkerEnv.from_env(env)


def test_a_worker_with_a_bad_metrics_port_does_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """init_from_env (a worker started by a platform) and a WorldManager of a program's own both
    refuse it, before anything runs."""
    env = {**WorkerEnv(pod="p").to_env(), ENV_METRICS_PORT: "abc"}
    program = "import multiworld\nmultiworld.init_from_env()"
    ended = subprocess.run(
        [sys.executable, "-c", program], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    assert ended.returncode == 1
    assert "ValueError: MULTIWORLD_METRICS_PORT='abc' is not a port" in ended.stderr

    from multiworld.manager import WorldManager

    monkeypatch.setenv(ENV_METRICS_PORT, "0")
    with pytest.raises(ValueError, match="MULTIWORLD_METRICS_PORT='0' is not a port"):
        WorldManager(pod="p")


def test_the_port_travels_in_the_worker_env() -> None:
    env = WorkerEnv(pod="p", metrics_port=9100)
    assert env.to_env()[ENV_METRICS_PORT] == "9100"
    assert WorkerEnv.from_env(env.to_env()) == env
    assert ENV_METRICS_PORT not in WorkerEnv(pod="p").to_env()
    assert WorkerEnv.from_env({**WorkerEnv(pod="p").to_env(), ENV_METRICS_PORT: " "}).metrics_port is None


def test_a_program_run_outside_a_member_is_told_how_to_run_it() -> None:
    with pytest.raises(ValueError, match=r"MULTIWORLD_POD, MULTIWORLD_WORLDS: .*`multiworld run FILE.yaml`"):
        WorkerEnv.from_env({})
