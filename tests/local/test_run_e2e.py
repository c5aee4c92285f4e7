"""`multiworld run` end to end: real member processes, real gloo worlds, injected kills.

Each run's JSON summary is checked: the world that lost a member failed and came back at a new
epoch with every rank joined, the other world saw zero errors, and no process outlived the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from pathlib import Path
from typing import IO, Any

import pytest
import yaml

from multiworld_operator.local.processes import RUN_ENV
from multiworld_operator.local.store_ports import unheld

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 300


def run_name(tmp_path: Path) -> str:
    """Unique per test, so that concurrent runs of the suite never see each other's members."""
    return f"e2e-{zlib.crc32(str(tmp_path).encode()):08x}"


def manifest(
    tmp_path: Path,
    worlds: list[dict] | None = None,
    members: list[dict] | None = None,
    example: str = "all_gather/multiworld.yaml",
    steps: int = 100000,
) -> Path:
    """A copy of an example's manifest (its path under examples/) with fast steps, and the
    topology given (else its own)."""
    doc = yaml.safe_load((REPO / "examples" / example).read_text())
    doc["metadata"]["name"] = run_name(tmp_path)
    if members is not None:
        doc["spec"]["members"] = members
    if worlds is not None:
        doc["spec"]["worlds"] = worlds
    doc["spec"]["template"]["spec"]["containers"][0]["args"] = ["--steps", str(steps), "--interval", "0.1"]
    path = tmp_path / "multiworld.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# The pods of SEED, without the run's name.
POD_NAMES = ["leader-0", "w1-0", "w1-1", "w2-0", "w2-1"]
SEED: dict[str, Any] = dict(
    members=[{"name": "leader"}, {"name": "w1", "replicas": 2}, {"name": "w2", "replicas": 2}],
    worlds=[{"name": "world1", "ranks": ["leader", "w1"]}, {"name": "world2", "ranks": ["leader", "w2"]}],
)


# A run with a fault ends once every world runs again; the bound only catches a recovery that
# never comes.
UNTIL_RECOVERED = ("--until-recovered", "--duration", "150")


def run(path: Path, tmp_path: Path, *flags: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "multiworld_operator.cli", "run", str(path), "--json", "--no-view",
         "--log-dir", str(tmp_path / "logs"), *flags],
        capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=REPO,
    )  # fmt: skip
    assert result.stdout.strip(), result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    summary["_stderr"] = result.stderr
    summary["_output"] = result.stdout + result.stderr
    summary["_rc"] = result.returncode
    assert summary["orphans"] == 0, result.stderr
    assert not leftover_processes(run_name(tmp_path)), "a member process outlived the run"
    return summary


def leftover_processes(name: str) -> list[int]:
    """Processes that the run of MultiWorld `name` started (members, spares and members that
    were spares), by the variable they all start with."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{RUN_ENV}={name}".encode() in env:
            found.append(int(pid))
    return found


def recovered_once(summary: dict, name: str) -> None:
    world = summary["worlds"][name]
    why = (name, world, summary["_stderr"])
    assert world["failures"] == 1, why
    assert world["recoveries"] == 1, why
    assert world["epoch"] == 2 and world["phase"] == "Running", why
    assert len(world["recovery_seconds"]) == 1 and world["recovery_seconds"][0] > 0


def starts(tmp_path: Path, pod: str) -> int:
    """How many processes member pod `pod` (`w1-0`) had in the run: one per start in its log."""
    return (tmp_path / "logs" / f"{run_name(tmp_path)}-{pod}.log").read_text().count("--- start ")


def test_killing_an_exclusive_member_rebuilds_only_its_world(tmp_path):
    """Only the dead pod is replaced: its live sibling w1-0 and the leader join world1's epoch 2
    in the processes they have."""
    summary = run(manifest(tmp_path, **SEED), tmp_path, "--kill", "w1:1", "--after", "5", *UNTIL_RECOVERED)
    recovered_once(summary, "world1")
    world2 = summary["worlds"]["world2"]
    assert (world2["failures"], world2["errors"], world2["epoch"]) == (0, 0, 1), summary["_stderr"]
    assert summary["_rc"] == 0
    assert {pod: starts(tmp_path, pod) for pod in ("leader-0", "w1-0", "w1-1", "w2-0")} == {
        "leader-0": 1,
        "w1-0": 1,
        "w1-1": 2,
        "w2-0": 1,
    }, summary["_stderr"]


def test_replace_world_restarts_every_pod_of_the_failed_world(tmp_path):
    """`failurePolicy.replace: World`: the kill restarts w1-0 too; the shared leader, alive in
    world2, stays."""
    whole = {"replace": "World"}
    worlds = [dict(w, failurePolicy=whole) for w in SEED["worlds"]]
    summary = run(
        manifest(tmp_path, members=SEED["members"], worlds=worlds), tmp_path,
        "--kill", "w1:1", "--after", "5", *UNTIL_RECOVERED,
    )  # fmt: skip
    recovered_once(summary, "world1")
    assert (starts(tmp_path, "w1-0"), starts(tmp_path, "w1-1"), starts(tmp_path, "leader-0")) == (2, 2, 1)


def test_a_program_that_stops_when_its_world_breaks_is_replaced(tmp_path):
    """A member program that prints and exits 0 when its world breaks (pymultiworld's examples'
    style): the kill fails the world, every survivor ends, and each ended pod is replaced; the
    world comes back at epoch 2."""
    path = manifest(tmp_path, members=[{"name": "a"}, {"name": "b", "replicas": 2}], worlds=[
        {"name": "solo", "ranks": ["a", "b"]}
    ])  # fmt: skip
    doc = yaml.safe_load(path.read_text())
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["command"], container["args"] = ["python", "tests/local/stop_on_break.py"], []
    path.write_text(yaml.safe_dump(doc))
    summary = run(path, tmp_path, "--kill", "b:1", "--after", "5", "--duration", "40")
    recovered_once(summary, "solo")
    assert [starts(tmp_path, pod) for pod in ("a-0", "b-0", "b-1")] == [2, 2, 2], summary["_stderr"]
    log = (tmp_path / "logs" / f"{run_name(tmp_path)}-a-0.log").read_text()
    assert "solo broke" in log and "stopping" in log and "solo epoch 2 step" in log, log


def test_killing_the_shared_member_fails_and_rebuilds_both_worlds(tmp_path):
    summary = run(manifest(tmp_path, **SEED), tmp_path, "--kill", "leader", "--after", "5", *UNTIL_RECOVERED)
    for world in ("world1", "world2"):
        recovered_once(summary, world)
    assert summary["_rc"] == 0


def test_killing_a_store_host_rebuilds_its_world_and_spares_the_other(tmp_path):
    # world2's rank 0 (its store host) is w2-0, a pod of world2 only.
    topology: dict[str, Any] = dict(
        members=[{"name": "leader"}, {"name": "w1", "replicas": 2}, {"name": "w2", "replicas": 2}],
        worlds=[{"name": "world1", "ranks": ["leader", "w1"]}, {"name": "world2", "ranks": ["w2", "leader"]}],
    )
    summary = run(manifest(tmp_path, **topology), tmp_path, "--kill", "w2:0", "--after", "5", *UNTIL_RECOVERED)
    recovered_once(summary, "world2")
    world1 = summary["worlds"]["world1"]
    assert (world1["failures"], world1["errors"], world1["epoch"]) == (0, 0, 1), summary["_stderr"]
    assert summary["_rc"] == 0


# Every manifest of the examples, variants included (serving's: tests/examples/test_examples_serving.py).
EXAMPLE_MANIFESTS = sorted(
    str(p.relative_to(REPO / "examples"))
    for p in (REPO / "examples").glob("*/multiworld*.yaml")
    if p.parent.name != "serving"
)


@pytest.mark.parametrize("example", EXAMPLE_MANIFESTS)
def test_every_example_manifest_runs_to_completion_locally(tmp_path, example):
    """The committed manifest as it is (its own members and worlds, the GPU variant's requests),
    only with fewer steps."""
    # The run ends by itself when every member finished its steps (--duration only bounds a hang).
    summary = run(manifest(tmp_path, example=example, steps=20), tmp_path, "--duration", "240")
    assert summary["_rc"] == 0, summary["_stderr"]
    for name, world in summary["worlds"].items():
        assert world["phase"] == "Succeeded", (name, summary["_stderr"])
        assert (world["failures"], world["errors"], world["epoch"]) == (0, 0, 1), (name, summary["_stderr"])


def test_a_plain_torch_world_loses_every_rank_to_one_death(tmp_path):
    """single_world's manifest: one plain torch.distributed world. A kill fails that world, so
    every one of its pods is recreated (the contrast with the multi-world examples)."""
    summary = run(
        manifest(tmp_path, example="single_world/multiworld.yaml"),
        tmp_path,
        "--kill",
        "workers:1",
        "--after",
        "4",
        *UNTIL_RECOVERED,
    )
    recovered_once(summary, "world")
    assert summary["_rc"] == 0
    log = (tmp_path / "logs" / f"{run_name(tmp_path)}-leader-0.log").read_text()
    assert log.count("--- start ") == 2, log


# How long the processes of a run may outlive its runner (its stop grace is 3 s).
OUTLIVED_S = 5.0


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
    ids=["ctrl-c", "sigterm", "hangup", "sigkill"],
)
def test_no_process_outlives_its_runner_whatever_signal_ends_it(tmp_path, sig):
    """No --duration: the run goes on until a signal. Ctrl-C, SIGTERM and a closed terminal
    (SIGHUP) stop every member and print the summary; SIGKILL cannot be caught, and the run's
    tether kills its members. Either way no member, warm spare included, outlives the runner."""
    path = manifest(tmp_path, **SEED)
    runner = subprocess.Popen(
        [sys.executable, "-m", "multiworld_operator.cli", "run", str(path), "--json", "--no-view",
         "--log-dir", str(tmp_path / "logs"), "--spares", "w1=1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert runner.stdout is not None
        running: set[str] = set()
        for line in runner.stdout:
            lines.append(line)
            if match := re.search(r"(world\d): Running epoch=1 ranks=3/3", line):
                running.add(match.group(1))
            if running == {"world1", "world2"}:
                break
        assert running == {"world1", "world2"}, "".join(lines)
        assert len(leftover_processes(run_name(tmp_path))) >= 6, "five member pods and a warm spare"
        runner.send_signal(sig)
        rest, _ = runner.communicate(timeout=60)
    finally:
        runner.kill()
        runner.wait()
    lines.append(rest)
    deadline = time.monotonic() + OUTLIVED_S
    while leftover_processes(run_name(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftover_processes(run_name(tmp_path)), "a member process outlived the run"
    if sig == signal.SIGKILL:
        return
    summary = json.loads(rest.strip().splitlines()[-1])
    assert runner.returncode == 0, "".join(lines)
    assert summary["orphans"] == 0
    assert {w["phase"] for w in summary["worlds"].values()} == {"Running"}, summary


def test_a_run_whose_worlds_never_run_exits_1_with_the_members_last_output(tmp_path):
    """Every member dies at start: its last output is shown once with its log's path, the
    members are said to crash-loop, and the run fails, saying so in its JSON."""
    script = tmp_path / "crash.py"
    script.write_text('print("loading the model")\nraise SystemExit("no weights at /models/x.pt")\n')
    path = manifest(tmp_path, **SEED)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["template"]["spec"]["containers"][0].update(command=["python", str(script)], args=[])
    path.write_text(yaml.safe_dump(doc))
    summary = run(path, tmp_path, "--duration", "8")
    err = summary["_stderr"]
    assert summary["_rc"] == 1, err
    assert not summary["ok"] and summary["problems"] == ["world world1 never ran", "world world2 never ran"]
    assert err.count("  | no weights at /models/x.pt") == 1, err
    assert "  | loading the model" in err and f"(log: {tmp_path / 'logs'}" in err, err
    assert "member w1 is crash-looping" in err, err
    assert "Traceback" not in err


def test_chaos_kills_members_and_the_worlds_recover(tmp_path):
    """Random kills (a kill during a recovery folds into it, and restarts back off): worlds fail
    and recover, none runs out of restarts, and nothing outlives the run."""
    summary = run(manifest(tmp_path, **SEED), tmp_path, "--chaos", "8", "--seed", "7", "--duration", "45")
    kills = summary["_output"].count("injecting failure: SIGKILL")
    worlds = summary["worlds"].values()
    assert kills >= 1, summary["_output"]
    assert sum(w["failures"] for w in worlds) >= 1, summary["_output"]
    assert sum(w["recoveries"] for w in worlds) >= 1, summary["_output"]
    assert {w["phase"] for w in worlds} <= {"Running", "Recovering"}, summary["_output"]
    assert summary["_rc"] == 0


SPARED: dict[str, Any] = dict(
    SEED, members=[{"name": "leader"}, {"name": "w1", "replicas": 2, "spares": 1}, {"name": "w2", "replicas": 2}]
)


def test_the_manifests_spares_take_the_killed_worlds_places(tmp_path):
    """spares: 1 on w1, no flag: one death takes one spare. world1 comes back with the spare (a
    process of w1's own command, started ahead of the kill) playing the killed w1-1, the live
    w1-0 in its own process, and no new process of a w1 pod."""
    summary = run(manifest(tmp_path, **SPARED), tmp_path, "--kill", "w1:1", "--after", "8", "--duration", "50")
    recovered_once(summary, "world1")
    name = run_name(tmp_path)
    out = summary["_stderr"]
    assert re.search(rf"SpareAssigned: warm spare {name}-w1-spare-a plays {name}-w1-1 ", out), out
    assert f"plays {name}-w1-0" not in out, out
    for pod in ("w1-0", "w1-1"):
        assert starts(tmp_path, pod) == 1, f"{pod} was restarted"
    spare_log = (tmp_path / "logs" / f"{name}-w1-spare-a.log").read_text()
    assert spare_log.count("--- start") == 1 and "from world1 has gathered tensors" in spare_log, spare_log
    world2 = summary["worlds"]["world2"]
    assert (world2["failures"], world2["errors"], world2["epoch"]) == (0, 0, 1), out


def test_spares_flag_overrides_the_manifest(tmp_path):
    summary = run(
        manifest(tmp_path, **SPARED), tmp_path, "--spares", "w1=0", "--kill", "w1:1", "--after", "5", *UNTIL_RECOVERED
    )
    recovered_once(summary, "world1")
    assert "SpareAssigned" not in summary["_stderr"] and "spare" not in " ".join(os.listdir(tmp_path / "logs"))


def test_suspend_stops_every_member_and_resume_brings_each_world_back_at_its_next_epoch(tmp_path):
    """`--suspend 4:6` sets spec.suspend for 6 s: every member process ends (no failure counted),
    then each world is made anew at epoch 2 and runs again."""
    summary = run(manifest(tmp_path, **SEED), tmp_path, "--suspend", "4:6", *UNTIL_RECOVERED)
    out = summary["_stderr"]
    assert "suspending: spec.suspend true" in out and "resuming: spec.suspend false" in out, out
    assert "WorldSuspended" in out and "WorldResumed" in out, out
    for name in ("world1", "world2"):
        world = summary["worlds"][name]
        assert (world["phase"], world["epoch"], world["failures"]) == ("Running", 2, 0), (name, out)
        assert (world["planned_changes"], world["errors"]) == (1, 0), (name, out)  # a suspend is no error
    assert {starts(tmp_path, pod) for pod in ("leader-0", "w1-0", "w1-1", "w2-0", "w2-1")} == {2}, out
    assert summary["_rc"] == 0


def test_a_bad_suspend_flag_names_it(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "multiworld_operator.cli", "run", str(manifest(tmp_path, **SEED)), "--suspend", "4"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert result.returncode != 0 and "--suspend '4': expected AFTER:FOR" in result.stderr, result.stderr


class Lines:
    """A running process's stream, read on a thread: what it said so far, and a wait for a line."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()

    def text(self) -> str:
        with self._cond:
            return "".join(self._lines)

    def wait_for(self, pattern: str, timeout: float) -> None:
        """Until a line matches `pattern` (a regular expression)."""
        with self._cond:
            if not self._cond.wait_for(lambda: any(re.search(pattern, line) for line in self._lines), timeout):
                raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{''.join(self._lines)}")


def test_an_edited_template_rolls_out_pod_by_pod_while_the_run_goes_on(tmp_path):
    """The manifest file edited during the run (w1's template gets an environment variable):
    the w1 pods are replaced one at a time by pods of the new template, each costing world1 one
    epoch and no restart; the leader and world2 never move. An invalid edit is refused, said,
    and changes nothing."""
    path = manifest(tmp_path, **SEED)
    runner = subprocess.Popen(
        [sys.executable, "-m", "multiworld_operator.cli", "run", str(path), "--json",
         "--log-dir", str(tmp_path / "logs"), "--duration", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    assert runner.stderr is not None
    heard = Lines(runner.stderr)
    try:
        heard.wait_for(r"world1: Running epoch=1 ", RUN_TIMEOUT / 3)
        doc = yaml.safe_load(path.read_text())
        path.write_text(yaml.safe_dump({**doc, "spec": {**doc["spec"], "worlds": []}}))  # invalid: refused
        heard.wait_for("manifest edit refused: ", RUN_TIMEOUT / 3)
        w1 = next(m for m in doc["spec"]["members"] if m["name"] == "w1")
        w1["template"] = json.loads(json.dumps(doc["spec"]["template"]))
        w1["template"]["spec"]["containers"][0]["env"] = [{"name": "ROLLOUT", "value": "2"}]
        path.write_text(yaml.safe_dump(doc))
        heard.wait_for(r"world1: Running epoch=3 ", RUN_TIMEOUT / 3)  # both pods replaced, world1 back
        runner.send_signal(signal.SIGINT)
        out, _ = runner.communicate(timeout=RUN_TIMEOUT)
    finally:
        runner.kill()
    err = heard.text()
    summary = json.loads(out.strip().splitlines()[-1])
    assert "manifest edit refused: " in err and "spec.worlds" in err, err
    assert err.count("PodUpdated") == 2 and err.count("manifest edited: applying it") == 1, err
    world1, world2 = summary["worlds"]["world1"], summary["worlds"]["world2"]
    assert (world1["phase"], world1["epoch"], world1["failures"]) == ("Running", 3, 0), err
    assert (world1["planned_changes"], world1["errors"]) == (2, 0), err  # a rollout is no error
    assert (world2["epoch"], world2["failures"], world2["errors"]) == (1, 0, 0), err
    assert [starts(tmp_path, pod) for pod in ("leader-0", "w1-0", "w1-1", "w2-0")] == [1, 2, 2, 1], err


def unheld_block(count: int) -> int:
    """The first of `count` consecutive ports nothing on this machine holds now, between the
    store ports (20000-29999) and the kernel's ephemeral ones."""
    for base in random.sample(range(30000, 32768 - count), 200):
        if all(unheld(port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in 30000-32767")


def joins(exposition: bytes | None, world: str) -> float | None:
    """multiworld_worker_joins_total of `world` in a worker's metrics page."""
    found = re.search(rf'^multiworld_worker_joins_total{{world="{world}"}} (\S+)$', (exposition or b"").decode(), re.M)
    return float(found.group(1)) if found else None


def test_every_process_of_a_run_serves_its_metrics_on_its_own_port(tmp_path):
    """The template asks for metrics on port P: the five pods, all on this machine, serve them on
    P..P+4 (one line says each), the worlds run, and a killed w1-1 comes back on its own port."""
    path = manifest(tmp_path, **SEED)
    doc = yaml.safe_load(path.read_text())
    base = unheld_block(len(POD_NAMES))
    doc["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "MULTIWORLD_METRICS_PORT", "value": str(base)}]
    path.write_text(yaml.safe_dump(doc))
    runner = subprocess.Popen(
        [sys.executable, "-m", "multiworld_operator.cli", "run", str(path), "--json",
         "--log-dir", str(tmp_path / "logs"), "--kill", "w1:1", "--after", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    assert runner.stderr is not None
    heard = Lines(runner.stderr)

    def scrape(port: int) -> bytes | None:
        with contextlib.suppress(OSError):
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
        return None

    ports = range(base, base + len(POD_NAMES))  # the pods start in the spec's order
    try:
        scraped: dict[int, bytes] = {}
        deadline = time.monotonic() + RUN_TIMEOUT / 2
        while len(scraped) < len(ports) and time.monotonic() < deadline:
            scraped |= {port: body for port in ports if (body := scrape(port)) is not None}
            time.sleep(0.5)
        w1_1 = base + POD_NAMES.index("w1-1")
        # world1 back: the leader and w1-0 joined it twice, w1-1's new process once.
        back = {base: 2, base + POD_NAMES.index("w1-0"): 2, w1_1: 1}
        while time.monotonic() < deadline:
            if starts(tmp_path, "w1-1") == 2 and all(joins(scrape(p), "world1") == n for p, n in back.items()):
                break
            time.sleep(0.5)
        again = scrape(w1_1)
        heard.wait_for(r"world1: Running epoch=2 ", RUN_TIMEOUT / 2)  # the runner heard the joins
        runner.send_signal(signal.SIGINT)  # what it came for is seen: Ctrl-C ends the run
        out, _ = runner.communicate(timeout=RUN_TIMEOUT)
    finally:
        runner.kill()
    err = heard.text()
    said = re.findall(r"pod \S+-(\S+-\d+) serves its metrics on port (\d+)", err)
    assert sorted(said) == sorted((pod, str(port)) for pod, port in zip(POD_NAMES, ports, strict=True)), err
    assert sorted(scraped) == list(ports) and all(b"multiworld_worker_joins_total" in b for b in scraped.values()), err
    assert again is not None and b"multiworld_worker_joins_total" in again, "w1-1's new process serves no metrics"
    summary = json.loads(out.strip().splitlines()[-1])
    recovered_once({**summary, "_stderr": err}, "world1")
    assert summary["worlds"]["world2"]["errors"] == 0 and starts(tmp_path, "w1-1") == 2, err
    assert "MULTIWORLD_METRICS_PORT" not in err, err
