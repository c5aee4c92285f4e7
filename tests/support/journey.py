"""Random topologies through random faults with `multiworld run`: the property journey's parts,
shared by tests/local/test_topology_journey.py (a small fixed budget) and bench/journeys.py (a
longer one, with figures).

`topologies()` draws a MultiWorld (members, worlds, replicas, spares: chains, rings, stars and
worlds sharing several members) and `faults()` a sequence of faults (a process killed, frozen
for a moment, a warm spare killed, one member's template edited, a suspend and resume).
`Journey` runs the example `all_gather` program in that MultiWorld, applies the faults while it
runs, and checks the invariants:

- once the faults stop, every world is Running with every rank joined within `SETTLE_S`, far
  below `failurePolicy.joinTimeout` (5 min): no wait the product causes lasts that long;
- a world moves (a new epoch) only if it holds a rank of a member that was faulted or whose
  template was edited, or after a suspend;
- a rollout completes: every process alive at the end runs its member's newest template.

A failure names the topology and the fault sequence (`Journey.describe`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hypothesis import assume, strategies as st

REPO = Path(__file__).resolve().parents[2]
RUN_ENV = "MULTIWORLD_RUN"
# Every world Running with every rank, this long after the last fault at most: the slowest
# recovery is a process start (seconds, minutes on a loaded machine) and one join; joinTimeout is
# 300 s.
SETTLE_S = 150.0
START_S = 240.0
# Longer than a failure takes to be seen (about a second) and planned.
QUIET_S = 3.0
MARKER = "JOURNEY_TEMPLATE"
_STATE = re.compile(r"^\[\s*([\d.]+)s\] (\S+): (\w+) epoch=(\d+) ranks=(\d+)/(\d+)")
KINDS = ("kill", "freeze", "kill_spare", "edit", "suspend")


@dataclass(frozen=True)
class Topology:
    shape: str
    replicas: tuple[int, ...]
    spares: tuple[int, ...]
    worlds: tuple[tuple[int, ...], ...]  # member indices of each world, in rank order

    def member(self, index: int) -> str:
        return f"m{index}"


@dataclass(frozen=True)
class Fault:
    kind: str
    member: int = 0
    after: float = 0.0  # seconds after the previous fault was applied

    def __str__(self) -> str:
        target = "" if self.kind == "suspend" else f" m{self.member}"
        return f"{self.kind}{target} after {self.after:.1f}s"


def _fits(worlds: Sequence[tuple[int, ...]], replicas: tuple[int, ...], max_pods: int) -> bool:
    counts = [sum(m in w for w in worlds) for m in range(len(replicas))]
    sizes = [sum(replicas[m] for m in w) for w in worlds]
    return all(0 < c <= 3 for c in counts) and all(s >= 2 for s in sizes) and sum(replicas) <= max_pods


@st.composite
def topologies(draw: st.DrawFn, max_members: int = 6, max_replicas: int = 3, max_pods: int = 10) -> Topology:
    """2 to `max_members` members, 2 to 5 worlds, each member in 1 to 3 worlds."""
    shape = draw(st.sampled_from(["chain", "ring", "star", "shared"]))
    worlds: list[tuple[int, ...]]
    if shape == "chain":
        n = draw(st.integers(3, min(6, max_members)))
        worlds = [(i, i + 1) for i in range(min(n - 1, 5))]
    elif shape == "ring":
        n = draw(st.integers(2, min(5, max_members)))
        worlds = [(i, (i + 1) % n) for i in range(n)] if n > 2 else [(0, 1), (1, 0)]
    elif shape == "star":
        n = draw(st.integers(3, min(4, max_members)))
        worlds = [(0, i) for i in range(1, n)]
    else:  # worlds sharing more than one member
        n = draw(st.integers(2, max_members))
        count = draw(st.integers(2, 5))
        drawn = [draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=3, unique=True)) for _ in range(count)]
        used = sorted({m for w in drawn for m in w})  # members in no world are left out
        n = len(used)
        worlds = [tuple(used.index(m) for m in w) for w in drawn]
    replicas = tuple(draw(st.lists(st.integers(1, max_replicas), min_size=n, max_size=n)))
    spares = tuple(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
    if not _fits(worlds, replicas, max_pods):
        replicas = tuple(1 for _ in range(n))
    assume(_fits(worlds, replicas, max_pods))
    return Topology(shape, replicas, spares, tuple(worlds))


def faults(members: int, max_faults: int = 3) -> st.SearchStrategy[list[Fault]]:
    fault = st.builds(Fault, kind=st.sampled_from(KINDS), member=st.integers(0, members - 1), after=st.floats(0.0, 3.0))
    return st.lists(fault, min_size=1, max_size=max_faults)


@dataclass
class _Seen:
    """What the runner's state lines said, per world: (phase, epoch, ready, size)."""

    worlds: dict[str, tuple[str, int, int, int]] = field(default_factory=dict)
    changed_at: float = 0.0  # monotonic time of the latest state line
    lines: list[str] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)


class Journey:
    def __init__(self, topology: Topology, sequence: list[Fault], workdir: Path, name: str) -> None:
        self.topology = topology
        self.sequence = sequence
        self.workdir = workdir
        self.name = name
        self.path = workdir / "journey.yaml"
        self.doc = self._manifest()
        self.figures: dict[str, float] = {}
        self._edits = 0
        self._seen = _Seen()
        self._runner: subprocess.Popen[str] | None = None

    def describe(self) -> str:
        t = self.topology
        worlds = ", ".join(f"w{i}=[{' '.join(f'm{m}' for m in w)}]" for i, w in enumerate(t.worlds))
        pairs = enumerate(zip(t.replicas, t.spares, strict=True))
        members = ", ".join(f"m{i} x{r}{' +spare' if s else ''}" for i, (r, s) in pairs)
        return f"{t.shape}: worlds {worlds}; members {members}; faults: {'; '.join(map(str, self.sequence))}"

    def _manifest(self) -> dict[str, Any]:
        t = self.topology
        container = {
            "name": "worker",
            "image": "ghcr.io/multiworld/worker:0.1.0",
            "command": ["python", "examples/all_gather/main.py"],
            "args": ["--steps", "100000", "--interval", "0.2"],
        }
        members = []
        for i, replicas in enumerate(t.replicas):
            member: dict[str, Any] = {"name": t.member(i), "replicas": replicas}
            if t.spares[i]:
                member["spares"] = t.spares[i]
            members.append(member)
        worlds = [{"name": f"w{i}", "ranks": [t.member(m) for m in w]} for i, w in enumerate(t.worlds)]
        return {
            "apiVersion": "multiworld.io/v1alpha1",
            "kind": "MultiWorld",
            "metadata": {"name": self.name},
            "spec": {"template": {"spec": {"containers": [container]}}, "members": members, "worlds": worlds},
        }

    def _write(self) -> None:
        self.path.write_text(yaml.safe_dump(self.doc))

    # -- running ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run the journey; the runner's summary. Raises AssertionError naming what broke."""
        self._write()
        runner = subprocess.Popen(
            [sys.executable, "-m", "multiworld_operator.cli", "run", str(self.path), "--json", "--no-view",
             "--log-dir", str(self.workdir / "logs")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        )  # fmt: skip
        self._runner = runner
        reader = threading.Thread(target=self._read, args=(runner,), daemon=True)
        reader.start()
        try:
            started = time.monotonic()
            self._until(self._all_running, START_S, "every world Running at start")
            self.figures["start_s"] = time.monotonic() - started
            for fault in self.sequence:
                time.sleep(fault.after)
                self._apply(fault)
            last = time.monotonic()
            time.sleep(QUIET_S)  # the last fault is seen and acted on meanwhile
            self._until(self._settled, SETTLE_S, "every world Running with every rank, the rollout done")
            # Settled at the last change of a world's state, whether before or after the pause.
            self.figures["settle_s"] = max(self._seen.changed_at - last, 0.0)
        finally:
            runner.send_signal(signal.SIGINT)
            try:
                out, _ = runner.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                runner.kill()
                out, _ = runner.communicate()
            reader.join(10)
        summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        self._check_moves(summary)
        assert summary["orphans"] == 0, f"orphan processes: {self.describe()}"
        return summary

    def _read(self, runner: subprocess.Popen[str]) -> None:
        assert runner.stderr is not None
        seen = self._seen
        for line in runner.stderr:
            found = _STATE.match(line)
            with seen.cond:
                seen.lines.append(line.rstrip())
                if found:
                    _, world, phase, epoch, ready, size = found.groups()
                    seen.worlds[world] = (phase, int(epoch), int(ready), int(size))
                    seen.changed_at = time.monotonic()
                seen.cond.notify_all()

    def _until(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        seen = self._seen
        with seen.cond:
            while not predicate():
                left = deadline - time.monotonic()
                assert left > 0, f"{what} not within {timeout:.0f}s: {self.describe()}\n" + "\n".join(seen.lines[-40:])
                seen.cond.wait(min(left, 1.0))

    def _all_running(self) -> bool:
        worlds = self._seen.worlds
        return len(worlds) == len(self.topology.worlds) and all(
            phase == "Running" and ready == size for phase, _, ready, size in worlds.values()
        )

    def _settled(self) -> bool:
        return self._all_running() and self._rolled_out()

    def _rolled_out(self) -> bool:
        """Every live process of an edited member runs its newest template."""
        for index, mark in self._marks().items():
            for env in self._processes(index):
                if env.get(MARKER) != mark:
                    return False
        return True

    def _marks(self) -> dict[int, str]:
        """Member index -> the marker of its newest template, for the members edited so far."""
        marks = {}
        for member in self.doc["spec"]["members"]:
            if "template" in member:
                env = member["template"]["spec"]["containers"][0]["env"]
                marks[int(member["name"][1:])] = next(e["value"] for e in env if e["name"] == MARKER)
        return marks

    def _processes(self, member: int) -> list[dict[str, str]]:
        """The environments of the live processes (pods and spares) of member `member`."""
        prefix = f"{self.name}-m{member}-"
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
            except OSError:
                continue
            env = dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)
            if state != "Z" and env.get(RUN_ENV) == self.name and env.get("MULTIWORLD_POD", "").startswith(prefix):
                env["_pid"] = pid
                found.append(env)
        return found

    # -- faults ----------------------------------------------------------------------------

    def _apply(self, fault: Fault) -> None:
        if fault.kind == "suspend":
            self._suspend()
            return
        if fault.kind == "edit":
            self._edit(fault.member)
            return
        processes = self._processes(fault.member)
        spares = [p for p in processes if "-spare-" in p.get("MULTIWORLD_POD", "")]
        targets = spares if fault.kind == "kill_spare" else [p for p in processes if p not in spares] or processes
        if not targets:
            return  # nothing of that kind runs now (a spare not started yet): the fault is a no-op
        pid = int(min(targets, key=lambda p: p["MULTIWORLD_POD"])["_pid"])
        try:
            if fault.kind == "freeze":
                os.kill(pid, signal.SIGSTOP)
                time.sleep(2.0)
                os.kill(pid, signal.SIGCONT)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _edit(self, member: int) -> None:
        self._edits += 1
        template = json.loads(json.dumps(self.doc["spec"]["template"]))
        template["spec"]["containers"][0]["env"] = [{"name": MARKER, "value": str(self._edits)}]
        for entry in self.doc["spec"]["members"]:
            if entry["name"] == f"m{member}":
                entry["template"] = template
        self._write()

    def _suspend(self) -> None:
        self.doc["spec"]["suspend"] = True
        self._write()
        self._until(
            lambda: all(phase == "Suspended" for phase, *_ in self._seen.worlds.values()), 60, "every world Suspended"
        )
        self.doc["spec"]["suspend"] = False
        self._write()

    # -- invariants ------------------------------------------------------------------------

    def _check_moves(self, summary: dict[str, Any]) -> None:
        if any(f.kind == "suspend" for f in self.sequence):
            return  # every world moves
        touched = {f.member for f in self.sequence if f.kind in ("kill", "freeze", "edit", "kill_spare")}
        for i, members in enumerate(self.topology.worlds):
            world = summary["worlds"][f"w{i}"]
            if world["epoch"] > 1:
                assert touched & set(members), (
                    f"world w{i} moved to epoch {world['epoch']} though none of its members was faulted: "
                    f"{self.describe()}"
                )
