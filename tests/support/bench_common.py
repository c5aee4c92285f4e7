"""What the bench scripts share: flags, member processes, statistics, tables, targets and the
final JSON line. No torch here: the coordinating process of a bench never needs it."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multiworld_operator.local.store_ports import free_store_ports
from tests.support.members import Member

REPO = Path(__file__).resolve().parents[2]

# Store ports as `multiworld run` picks them: none that the kernel hands out to other sockets.
free_ports = free_store_ports


# Members share two cores with everything else: one compute thread each keeps them from
# fighting over the cores more than the benchmark itself makes them.
MEMBER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

# Generous: several processes importing torch at once on a busy machine.
MEMBER_WAIT_S = 180.0


class BenchParser(argparse.ArgumentParser):
    """Flags every bench has: --quick (smallest settings, for the smoke test) and --json; and
    settings whose default depends on --quick (`setting`), resolved by `parse_args`."""

    def __init__(self, description: str | None) -> None:
        super().__init__(description=description)
        self.add_argument(
            "--quick", action="store_true", help="smallest settings: checks the bench runs, not the figures"
        )
        self.add_argument("--json", action="store_true", help="end with the results as one JSON line")
        self._by_quick: dict[str, tuple[float, float]] = {}

    def setting(self, flag: str, convert: type, full: float, quick: float, help: str) -> None:
        """A positive number `flag`: `full` by default, `quick` with --quick."""
        action = self.add_argument(
            flag, type=positive(convert), default=None, help=f"{help} (default {full:g}; {quick:g} with --quick)"
        )
        self._by_quick[action.dest] = (full, quick)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]  # one signature: argparse's overloads add nothing here
        parsed = super().parse_args(args, namespace)
        for dest, (full, quick) in self._by_quick.items():
            if getattr(parsed, dest) is None:
                setattr(parsed, dest, quick if parsed.quick else full)
        return parsed


def parser(description: str | None) -> BenchParser:
    return BenchParser(description)


def credentials_flag(p: argparse.ArgumentParser) -> None:
    """--as {chart,admin}, for the benches that run `multiworld operator` (args.credentials)."""
    p.add_argument(
        "--as",
        dest="credentials",
        choices=("chart", "admin"),
        default="chart",
        help="the operator's credentials: the chart's ServiceAccount (default) or the cluster admin",
    )


def positive(convert: type) -> Any:
    """An argparse type that refuses values <= 0."""

    def parse(text: str) -> Any:
        value = convert(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = convert.__name__
    return parse


def status_field(pid: int | str, name: str) -> int:
    """A number of /proc/<pid>/status (`pid` "self": this process), in its unit (kB for memory)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise KeyError(name)


def machine_load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min) on {os.cpu_count()} cores"


# ---- statistics ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        data = list(values)
        if not data:
            raise ValueError("no values to summarize")
        return cls(min(data), statistics.median(data), max(data))

    def as_dict(self) -> dict[str, float]:
        return {"min": self.min, "median": self.median, "max": self.max}


def p99(values: Sequence[float]) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def gaps(times: Sequence[float]) -> list[float]:
    """Intervals between consecutive timestamps."""
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def worst_gap_in(times: Sequence[float], windows: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The longest interval between consecutive timestamps that overlaps any window, and
    where it starts relative to the start of that window (0.0, 0.0 when none overlaps)."""
    worst, offset = 0.0, 0.0
    for a, b in zip(times, times[1:], strict=False):
        for start, end in windows:
            if a < end and b > start and b - a > worst:
                worst, offset = b - a, a - start
    return worst, offset


# ---- output --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A figure against its limit (lower is better)."""

    what: str
    value: float
    limit: float
    unit: str = ""

    @property
    def passed(self) -> bool:
        return math.isfinite(self.value) and self.value <= self.limit

    def line(self) -> str:
        verdict = "PASS" if self.passed else "MISS"
        return f"  {verdict}  {self.what}: {self.value:.3g}{self.unit} (target <= {self.limit:g}{self.unit})"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = [list(headers)] + [list(r) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=False)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(title: str, load_at_start: str, body: Sequence[str], targets: Sequence[Target]) -> None:
    """The readable part of a bench's output (stdout, before any JSON line)."""
    print(f"== {title}")
    print(f"at the start: {load_at_start}")
    print(f"at the end:   {machine_load()}")
    for block in body:
        print()
        print(block)
    print()
    print("targets:")
    for target in targets:
        print(target.line())
    sys.stdout.flush()


def json_line(results: dict[str, Any]) -> None:
    print(json.dumps(results, separators=(",", ":")), flush=True)


def fmt_s(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(count: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size and count % size == 0:
            return f"{count // size} {unit}"
    return f"{count} B"


# ---- member processes -----------------------------------------------------------------------


def emit(event: str, **fields: Any) -> None:
    """A member's event: one JSON line on stdout, read by its coordinator."""
    print(json.dumps({"event": event, "at": time.time(), **fields}), flush=True)


def program(file: str) -> list[str]:
    """The arguments after `python` that run the bench whose `__file__` is `file` as a program
    again (`-m bench.NAME`, from the repository root, where members and pods start)."""
    return ["-m", ".".join(Path(file).resolve().relative_to(REPO).with_suffix("").parts)]


class Members:
    """Every member a bench started, each running `program` (see `program`); all still running
    are killed on exit (SIGKILL also ends SIGSTOPped ones)."""

    def __init__(self, program: Sequence[str]) -> None:
        self.program = list(program)
        self.started: list[Member] = []

    def start(self, name: str, args: Sequence[str]) -> Member:
        member = Member([*self.program, *args], name, env=MEMBER_ENV, cwd=REPO, wait_s=MEMBER_WAIT_S)
        self.started.append(member)
        return member

    def __enter__(self) -> Members:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for member in self.started:
            member.kill()


def commands() -> Iterable[dict[str, Any]]:
    """A member's commands from its coordinator: JSON lines on stdin, until EOF."""
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


# ---- multiworld run ---------------------------------------------------------------------------


def run_local(
    cmd: Sequence[str], on_stderr: Callable[[str, subprocess.Popen[str]], None], env: dict[str, str] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Run `multiworld run ... --json` (cmd) to its end. Each line of its log (stderr) goes to
    `on_stderr` as soon as it is written, with the process (to signal it); returns the run's
    summary (its last stdout line) and its log lines."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.extend(proc.stdout or []), daemon=True)
    reader.start()
    log: list[str] = []
    for line in proc.stderr:
        log.append(line.rstrip("\n"))
        on_stderr(log[-1], proc)
    proc.wait()
    reader.join(30)
    lines = [line for line in stdout if line.strip()]
    if not lines:
        raise RuntimeError("multiworld run printed no summary:\n" + "\n".join(log[-30:]))
    return json.loads(lines[-1]), log
