"""Recovery time of `multiworld run` after an exclusive member is killed, and what it costs
the world that lost nobody.

The seed topology (examples/all_gather/multiworld.yaml: leader in world1 and world2, w1 and w2
with two replicas each) runs with fast steps; `--kill w1:1` fires several times, spaced so that
each recovery ends before the next kill, and world1's restart backoff is off (initialDelay 0s),
so that every kill times a recovery rather than the backoff policy. The runner's warm spares
are as it ships them (--spares changes that; 0 shows cold starts). Figures:
  recovery      the runner's summary (recovery_seconds of world1): from the kill to world1
                Running again at a new epoch with every rank joined
  torch import  `python -c "import torch"` wall time (interpreter start included), measured in
                this run before the manifest starts
  breakdown     per kill, from timestamps: the leader seeing world1 break, the replacement
                process running its script (a cold start, or a warm spare of the runner), its
                torch import, its first step in the new epoch
  unaffected    world2's steps as the leader logs them: its worst step gap inside the recovery
                windows (kill to recovery + 1 s) over its median step, and its errors from the
                runner's summary
Members run the unmodified example through a launcher (this script with --launch) that
timestamps every line the example prints and times the torch import on its own.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import _common as common

SEED_MANIFEST = common.REPO / "examples" / "all_gather" / "multiworld.yaml"
NAME = "bench-recovery"
BROKEN_WORLD = "world1"
UNAFFECTED = "world2"
VICTIM = "w1:1"
# world1's exclusive pods: both are restarted when world1 fails.
EXCLUSIVE_PODS = (f"{NAME}-w1-0", f"{NAME}-w1-1")
LEADER_POD = f"{NAME}-leader-0"
RECOVERY_LIMIT_S = 3.0
GAP_LIMIT = 3.0
LAUNCH = "--launch"
# Launcher lines: "@<unix time> <line the example printed>".
STAMP = re.compile(r"^@(\d+\.\d+) (.*)$")
MARK_UP = "bench: launcher running"
MARK_TORCH = "bench: torch imported"


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--kills", type=common.positive(int), default=None,
                   help="how many times w1:1 is killed (default 5; 1 with --quick)")
    p.add_argument("--first-after", type=common.positive(float), default=10.0,
                   help="seconds after every world first ran until the first kill, so that the "
                        "runner's spares are warm (default 10)")
    p.add_argument("--spacing", type=common.positive(float), default=15.0,
                   help="seconds between kills: a recovery, and the runner refilling its spares "
                        "(default 15)")
    p.add_argument("--interval", type=common.positive(float), default=0.05,
                   help="the example's --interval between steps, seconds (default 0.05)")
    p.add_argument("--spares", type=int, default=None,
                   help="the runner's --spares (warm spare processes); default: the runner's own")
    p.add_argument("--imports", type=common.positive(int), default=3,
                   help="how many times `python -c 'import torch'` is timed (default 3)")
    p.add_argument("--keep-logs", action="store_true", help="keep the members' logs (their folder is printed)")
    args = p.parse_args(argv)
    args.kills = args.kills or (1 if args.quick else 5)
    if args.spares is not None and args.spares < 0:
        p.error(f"--spares must be >= 0, got {args.spares}")
    return args


# ---- the launcher (inside each member) ---------------------------------------------------------


class Stamped:
    """A text stream that prefixes every complete line with the time its newline was written."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
            if lines:
                now = time.time()
                self._out.write("".join(f"@{now:.6f} {line}\n" for line in lines))
                self._out.flush()
        return len(text)

    def flush(self) -> None:
        self._out.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return self._out.encoding


def launch(argv: list[str]) -> None:
    """Run the script argv[0] as __main__ with argv, its output line-stamped; torch is imported
    first, on its own clock."""
    sys.stdout = Stamped(sys.stdout)  # type: ignore[assignment]
    print(MARK_UP)
    import torch  # noqa: F401

    print(MARK_TORCH)
    sys.argv = list(argv)
    sys.path[0] = str(Path(argv[0]).resolve().parent)
    runpy.run_path(argv[0], run_name="__main__")


# ---- measuring -----------------------------------------------------------------------------------


def time_torch_import(count: int) -> list[float]:
    out = []
    for _ in range(count):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, env={**os.environ, **common.MEMBER_ENV})
        out.append(time.perf_counter() - started)
    return out


def write_manifest(path: Path, interval: float, kills: int) -> None:
    import yaml

    doc = yaml.safe_load(SEED_MANIFEST.read_text())
    doc["metadata"]["name"] = NAME
    for world in doc["spec"]["worlds"]:
        if world["name"] == BROKEN_WORLD:
            # Every kill times a recovery, not the restart backoff (1s, 2s, 4s... after the first).
            world["failurePolicy"] = {"maxRestarts": kills + 1, "backoff": {"initialDelay": "0s"}}
    container = doc["spec"]["template"]["spec"]["containers"][0]
    script = next(a for a in container["command"] if a.endswith(".py"))
    container["command"] = ["python", str(Path(__file__).resolve().relative_to(common.REPO)), LAUNCH, script]
    container["args"] = ["--steps", "1000000", "--interval", str(interval)]
    path.write_text(yaml.safe_dump(doc))


@dataclass
class RunnerOutput:
    summary: dict[str, Any]
    kills: list[float] = field(default_factory=list)  # when each kill was announced (unix time)
    stderr: list[str] = field(default_factory=list)


def run_manifest(args: Any, manifest: Path, log_dir: Path) -> RunnerOutput:
    """`multiworld run` with the kills; stopped (SIGTERM, a clean stop) once world1 is back
    after the last kill."""
    afters = [args.first_after + i * args.spacing for i in range(args.kills)]
    cmd = [sys.executable, "-m", "multiworld_operator.cli", "run", str(manifest), "--json", "--no-view",
           "--log-dir", str(log_dir), "--workdir", str(common.REPO)]
    for after in afters:
        cmd += ["--kill", VICTIM, "--after", str(after)]
    if args.spares is not None:
        cmd += ["--spares", str(args.spares)]
    # A cap, should world1 never come back: start-up, the kills, and slow recoveries.
    cmd += ["--duration", str(180 + afters[-1] + 60)]
    out = RunnerOutput(summary={})
    back = re.compile(rf"\] {BROKEN_WORLD}: Running epoch={args.kills + 1} ranks=(\d+)/\1 ")

    def watch(line: str, proc: subprocess.Popen[str]) -> None:
        if "injecting failure: SIGKILL" in line:
            out.kills.append(time.time())
        if back.search(line):
            time.sleep(1.0)  # a little steady state after the last recovery
            proc.send_signal(signal.SIGTERM)

    out.summary, out.stderr = common.run_local(cmd, watch)
    return out


@dataclass
class Incarnation:
    spare: bool
    up: float | None = None  # the launcher runs the script's process
    torch: float | None = None  # torch imported
    first_step: float | None = None  # first all_gather done


def stamped_lines(path: Path) -> list[tuple[float | None, str]]:
    out: list[tuple[float | None, str]] = []
    for line in path.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        out.append((float(m.group(1)), m.group(2)) if m else (None, line))
    return out


def incarnations(path: Path) -> list[Incarnation]:
    found: list[Incarnation] = []
    for at, line in stamped_lines(path):
        if at is None:
            if line.startswith("--- start"):
                found.append(Incarnation(spare="warm spare" in line))
            continue
        if not found:
            continue
        current = found[-1]
        if line == MARK_UP:
            current.up = at
        elif line == MARK_TORCH:
            current.torch = at
        elif "has gathered tensors" in line and current.first_step is None:
            current.first_step = at
    return found


def leader_times(path: Path) -> tuple[list[float], list[float], list[float]]:
    """(world2 step times, world1 break times, world1 rejoin times) from the leader's log."""
    steps, broke, rejoined = [], [], []
    for at, line in stamped_lines(path):
        if at is None:
            continue
        if f"from {UNAFFECTED} has gathered" in line:
            steps.append(at)
        elif line.startswith(f"{BROKEN_WORLD} broke:"):
            broke.append(at)
        elif line.startswith(f"{BROKEN_WORLD} rejoined at epoch"):
            rejoined.append(at)
    return steps, broke, rejoined


def after(times: list[float], start: float) -> float | None:
    return next((t for t in times if t >= start), None)


def kill_row(
    index: int, kill: float, recovery: float | None, seen: float | None, back: float | None,
    restarted: list[list[Incarnation]],
) -> list[str]:
    """One kill: the recovery, and when the slowest of the replacements got where (w1's pods are
    both restarted: world1 is the only world of each)."""
    replacements = [next((inc for inc in incs if inc.up is not None and inc.up >= kill), None) for incs in restarted]
    found = [inc for inc in replacements if inc is not None]
    last = max(found, key=lambda inc: inc.first_step or inc.up or 0.0, default=None)
    spares = sum(inc.spare for inc in found)
    kinds = f"{spares} spare, {len(found) - spares} new" if found else "-"

    def since(a: float | None, b: float | None) -> str:
        return ms(a - b if a is not None and b is not None else None)

    return [
        str(index + 1),
        "-" if recovery is None else f"{recovery:.2f} s",
        since(seen, kill),
        kinds,
        since(last.up if last else None, kill),
        since(last.torch if last else None, last.up if last else None),
        since(last.first_step if last else None, last.torch if last else None),
        since(back, kill),
    ]


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def coordinate(args: Any) -> int:
    load = common.machine_load()
    imports = time_torch_import(args.imports)
    torch_import_s = statistics.median(imports)
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    manifest = work / "multiworld.yaml"
    write_manifest(manifest, args.interval, args.kills)
    run = run_manifest(args, manifest, work / "logs")
    (work / "runner.log").write_text("\n".join(run.stderr) + "\n")
    world1 = run.summary["worlds"][BROKEN_WORLD]
    world2 = run.summary["worlds"][UNAFFECTED]
    recoveries: list[float] = world1["recovery_seconds"]
    if not recoveries:
        raise RuntimeError(f"{BROKEN_WORLD} never recovered: {world1}\n" + "\n".join(run.stderr[-30:]))

    steps, broke, rejoined = leader_times(work / "logs" / f"{LEADER_POD}.log")
    restarted = [incarnations(work / "logs" / f"{pod}.log") for pod in EXCLUSIVE_PODS]
    rows = []
    for i, kill in enumerate(run.kills):
        rows.append(kill_row(i, kill, recoveries[i] if i < len(recoveries) else None,
                             after(broke, kill), after(rejoined, kill), restarted))
    breakdown = common.table(
        ["kill", "recovery", "leader saw break", "replacements", "last script running", "+ torch import",
         "+ first step", "leader rejoined"], rows)
    warnings = []
    if world1["failures"] != len(run.kills) or len(recoveries) != len(run.kills):
        warnings.append(f"warning: {len(run.kills)} kills, but {BROKEN_WORLD} had {world1['failures']} failures and "
                        f"{len(recoveries)} recoveries (a failure the bench did not cause, or overlapping "
                        "recoveries: see --keep-logs)")

    median_step = statistics.median(common.gaps(steps))
    windows = [(k, k + r + 1.0) for k, r in zip(run.kills, recoveries)]
    worst, offset = common.worst_gap_in(steps, windows)
    quiet_windows = [(k - 2.0, k) for k in run.kills]
    quiet, _ = common.worst_gap_in(steps, quiet_windows)
    recovery = common.Spread.of(recoveries)
    figures = common.table(["figure", "value"], [
        ["recoveries (min / median / max)",
         f"{recovery.min:.2f} / {recovery.median:.2f} / {recovery.max:.2f} s over {len(recoveries)} kills"],
        ["python -c 'import torch' (median of runs)", f"{torch_import_s:.2f} s ({', '.join(f'{t:.2f}' for t in imports)})"],
        [f"{UNAFFECTED} median step", common.fmt_s(median_step)],
        [f"{UNAFFECTED} worst gap in recovery windows / median", f"{worst / median_step:.2f} ({offset:+.2f} s after a kill)"],
        [f"{UNAFFECTED} worst gap in the 2 s before kills / median", f"{quiet / median_step:.2f}"],
        [f"{UNAFFECTED} errors / failures", f"{world2['errors']} / {world2['failures']}"],
        [f"{BROKEN_WORLD} errors raised to the members", str(world1["errors"])],
        ["orphan processes", str(run.summary["orphans"])],
    ])
    targets = [
        common.Target("median recovery", recovery.median, RECOVERY_LIMIT_S, " s"),
        common.Target(f"{UNAFFECTED} worst gap / median step", worst / median_step, GAP_LIMIT),
        common.Target(f"{UNAFFECTED} errors", world2["errors"], 0),
    ]
    notes = f"logs: {work} (runner.log, logs/<pod>.log)" if args.keep_logs else ""
    common.report("recovery: multiworld run, seed topology, --kill w1:1", load,
                  [figures, "per kill (times from the kill):\n" + breakdown, *warnings, *([notes] if notes else [])],
                  targets)
    if not args.keep_logs:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        common.json_line({
            "recovery_s": recovery.as_dict(),
            "torch_import_s": torch_import_s,
            "unaffected": {"worst_gap_ratio": worst / median_step, "errors": world2["errors"]},
        })
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [LAUNCH]:
        launch(argv[1:])
        return 0
    return coordinate(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
