"""Recovery time of `multiworld run` after an exclusive member is killed, and what it costs
the world that lost nobody.

The seed topology (examples/all_gather/multiworld.yaml: leader in world1 and world2, w1 and w2
with two replicas each) runs with fast steps; the runner's `--kill w1:1` fires several times
(it kills whichever process plays pod w1-1: a warm spare, once one does), spaced so that each
recovery ends before the next kill, and world1's restart backoff is off (initialDelay 0s), so
that every kill times a recovery rather than the backoff policy. By default w1 keeps 2 warm
spares (`--spares w1=2`: as many as world1 has exclusive pods, since a recovery replaces both
w1-0 and w1-1); this bench's --spares is passed to the runner instead (`--spares 0` shows cold
starts). Clocks (all wall-clock unix time; the runner's event lines are placed on it through
their elapsed-time prefix (10 ms steps), offset by the smallest lag seen between a line's
elapsed time and the moment the bench read it):
  recovery      the runner's summary (recovery_seconds of world1): from the runner injecting the
                kill to the runner seeing world1 Running again at a new epoch with every rank
                joined (the runner's monotonic clock)
  torch import  `python -c "import torch"` wall time (interpreter start included), measured in
                this run before the manifest starts
  breakdown     per kill, every column from the kill (the runner's "injecting failure" line,
                written just before its SIGKILL) to:
                  leader saw break   the leader printing "world1 broke"
                  replacements       what took world1's exclusive pods after the kill: a warm
                                     spare (the runner's SpareAssigned line names it, its log
                                     is the spare's own) or a new process of the pod's own name
                                     (a cold start, its log the pod's) - then, for the one of
                                     them whose first step came last:
                  spare assigned     the runner's SpareAssigned line for it ("-": a new process)
                  script running     its launcher's first line ("before the kill": a spare,
                                     started ahead of need)
                  torch imported     its launcher's line after `import torch` (idem)
                  first step         its first all_gather done, which is in the new epoch (a
                                     spare has no world until it plays a member pod)
                  leader rejoined    the leader printing "world1 rejoined at epoch"
  unaffected    world2's steps as the leader logs them: its worst step gap inside the recovery
                windows (kill to recovery + 1 s) over its median step, and its errors from the
                runner's summary
Members (spares too) run the unmodified example through a launcher (this script with --launch)
that timestamps every line the example prints and times the torch import on its own; a spare's
script then blocks in init_from_env() until the runner gives it a member pod to play.
"""

from __future__ import annotations

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

from tests.support import bench_common as common

SEED_MANIFEST = common.REPO / "examples" / "all_gather" / "multiworld.yaml"
NAME = "bench-recovery"
BROKEN_WORLD = "world1"
UNAFFECTED = "world2"
VICTIM = "w1:1"
# world1's exclusive pods: both get a new process (a warm spare, or a cold start) when world1 fails.
EXCLUSIVE_PODS = (f"{NAME}-w1-0", f"{NAME}-w1-1")
# The runner's warm spares unless --spares says otherwise: one per exclusive pod of world1.
DEFAULT_SPARES = [f"w1={len(EXCLUSIVE_PODS)}"]
LEADER_POD = f"{NAME}-leader-0"
RECOVERY_LIMIT_S = 3.0
GAP_LIMIT = 3.0
LAUNCH = "--launch"
# Launcher lines: "@<unix time> <line the example printed>".
STAMP = re.compile(r"^@(\d+\.\d+) (.*)$")
MARK_UP = "bench: launcher running"
MARK_TORCH = "bench: torch imported"
# The runner's log lines (--no-view): "[<seconds since it started>s] <message>".
RUNNER_LINE = re.compile(r"^\[\s*(\d+\.\d+)s\] (.*)$")
KILLED = re.compile(r"^injecting failure: SIGKILL (\S+)")
ASSIGNED = re.compile(r"SpareAssigned: warm spare (\S+) plays (\S+) ")


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.setting("--kills", int, 5, 1, "how many times w1:1 is killed")
    p.add_argument(
        "--first-after",
        type=common.positive(float),
        default=10.0,
        help="seconds after every world first ran until the first kill, so that the "
        "runner's spares are warm (default 10)",
    )
    p.add_argument(
        "--spacing",
        type=common.positive(float),
        default=15.0,
        help="seconds between kills: a recovery, and the runner refilling its spares (default 15)",
    )
    p.add_argument(
        "--interval",
        type=common.positive(float),
        default=0.05,
        help="the example's --interval between steps, seconds (default 0.05)",
    )
    p.add_argument(
        "--spares",
        action="append",
        default=None,
        metavar="[MEMBER=]N",
        help="the runner's --spares, passed through (repeatable): N warm spares of every member, "
        "or MEMBER=N of one; 0 shows cold starts (default: " + " ".join(DEFAULT_SPARES) + ")",
    )
    p.add_argument(
        "--imports",
        type=common.positive(int),
        default=3,
        help="how many times `python -c 'import torch'` is timed (default 3)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the members' logs (their folder is printed)")
    args = p.parse_args(argv)
    args.spares = args.spares or list(DEFAULT_SPARES)
    # Checked here, as the runner will read them, so that a bad choice fails before any run.
    from multiworld_operator.commands.run import with_spares
    from multiworld_operator.spec import load_manifest

    try:
        with_spares(load_manifest(SEED_MANIFEST), args.spares)
    except ValueError as error:
        p.error(str(error))
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
    sys.stdout = Stamped(sys.stdout)
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
    container["command"] = ["python", *common.program(__file__), LAUNCH, script]
    container["args"] = ["--steps", "1000000", "--interval", str(interval)]
    path.write_text(yaml.safe_dump(doc))


@dataclass
class RunnerOutput:
    summary: dict[str, Any]
    stderr: list[str] = field(default_factory=list)
    read_at: list[float] = field(default_factory=list)  # when the bench read each stderr line (unix time)
    kills: list[float] = field(default_factory=list)  # when each kill was injected (unix time)
    assigned: list[tuple[float, str, str]] = field(default_factory=list)  # (when, spare, member pod)

    def place_events(self) -> None:
        """The kills and spare assignments on the unix clock: the runner's elapsed seconds plus its
        start, estimated as the smallest (read time - elapsed) over its lines (a line is read a
        little after it is written, never before)."""
        stamped = [
            (at, float(m.group(1)), m.group(2))
            for at, line in zip(self.read_at, self.stderr, strict=True)
            if (m := RUNNER_LINE.match(line))
        ]
        if not stamped:
            return
        start = min(at - elapsed for at, elapsed, _ in stamped)
        for _, elapsed, message in stamped:
            if KILLED.match(message):
                self.kills.append(start + elapsed)
            elif m := ASSIGNED.search(message):
                self.assigned.append((start + elapsed, m.group(1), m.group(2)))


def run_manifest(args: Any, manifest: Path, log_dir: Path) -> RunnerOutput:
    """`multiworld run` with the kills; stopped (SIGTERM, a clean stop) once world1 is back
    after the last kill."""
    afters = [args.first_after + i * args.spacing for i in range(args.kills)]
    cmd = [sys.executable, "-m", "multiworld_operator.cli", "run", str(manifest), "--json", "--no-view",
           "--log-dir", str(log_dir), "--workdir", str(common.REPO)]  # fmt: skip
    for after in afters:
        cmd += ["--kill", VICTIM, "--after", str(after)]
    for choice in args.spares:
        cmd += ["--spares", choice]
    # A cap, should world1 never come back: start-up, the kills, and slow recoveries.
    cmd += ["--duration", str(180 + afters[-1] + 60)]
    out = RunnerOutput(summary={})
    back = re.compile(rf"\] {BROKEN_WORLD}: Running epoch={args.kills + 1} ranks=(\d+)/\1 ")

    def watch(line: str, proc: subprocess.Popen[str]) -> None:
        out.read_at.append(time.time())
        if back.search(line):
            time.sleep(1.0)  # a little steady state after the last recovery
            proc.send_signal(signal.SIGTERM)

    out.summary, out.stderr = common.run_local(cmd, watch)
    out.place_events()
    return out


@dataclass
class Incarnation:
    """One process's marks, from its log (a pod's log holds one per start, a spare's one)."""

    up: float | None = None  # the launcher runs (the script's process is up)
    torch: float | None = None  # torch imported
    first_step: float | None = None  # first all_gather done


@dataclass
class Replacement:
    """The process that took one of world1's exclusive pods after a kill."""

    pod: str
    process: str  # a spare's name, or the pod's own (a new process)
    spare: bool
    assigned: float | None  # the runner's SpareAssigned line (a spare)
    marks: Incarnation


def stamped_lines(path: Path) -> list[tuple[float | None, str]]:
    out: list[tuple[float | None, str]] = []
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        out.append((float(m.group(1)), m.group(2)) if m else (None, line))
    return out


def incarnations(path: Path) -> list[Incarnation]:
    found: list[Incarnation] = []
    for at, line in stamped_lines(path):
        if at is None:
            if line.startswith("--- start"):
                found.append(Incarnation())
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


def replacements(kill: float, until: float, assigned: list[tuple[float, str, str]], logs: Path) -> list[Replacement]:
    """Per exclusive pod, the process that took it in [kill, until): the first spare assigned to
    play it, else the first new process of its own name."""
    found = []
    for pod in EXCLUSIVE_PODS:
        spare = next(((at, name) for at, name, plays in assigned if plays == pod and kill <= at < until), None)
        if spare is not None:
            marks = incarnations(logs / f"{spare[1]}.log")
            found.append(Replacement(pod, spare[1], True, spare[0], marks[-1] if marks else Incarnation()))
            continue
        new = next(
            (inc for inc in incarnations(logs / f"{pod}.log") if inc.up is not None and kill <= inc.up < until), None
        )
        if new is not None:
            found.append(Replacement(pod, pod, False, None, new))
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


def kinds(found: list[Replacement]) -> str:
    spares = sum(r.spare for r in found)
    return f"{spares} spare, {len(found) - spares} new" if found else "-"


def last_of(found: list[Replacement]) -> Replacement | None:
    """The replacement whose first step came last (one that never stepped counts as last)."""
    return max(found, key=lambda r: r.marks.first_step or float("inf"), default=None)


def kill_row(
    index: int,
    kill: float,
    recovery: float | None,
    seen: float | None,
    back: float | None,
    found: list[Replacement],
) -> list[str]:
    """One kill: the recovery, and when the slowest of the replacements got where, from the kill."""
    last = last_of(found)

    def since(at: float | None) -> str:
        if at is None:
            return "-"
        return "before the kill" if at < kill else ms(at - kill)

    return [
        str(index + 1),
        "-" if recovery is None else f"{recovery:.2f} s",
        since(seen),
        kinds(found),
        since(last.assigned if last else None),
        since(last.marks.up if last else None),
        since(last.marks.torch if last else None),
        since(last.marks.first_step if last else None),
        since(back),
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
    rows, per_kill = [], []
    for i, kill in enumerate(run.kills):
        until = run.kills[i + 1] if i + 1 < len(run.kills) else float("inf")
        found = replacements(kill, until, run.assigned, work / "logs")
        per_kill.append(found)
        rows.append(
            kill_row(
                i,
                kill,
                recoveries[i] if i < len(recoveries) else None,
                after(broke, kill),
                after(rejoined, kill),
                found,
            )
        )
    breakdown = common.table(
        [
            "kill",
            "recovery",
            "leader saw break",
            "replacements",
            "spare assigned",
            "script running",
            "torch imported",
            "first step",
            "leader rejoined",
        ],
        rows,
    )
    everyone = [r for found in per_kill for r in found]
    to_first_step = [
        last.marks.first_step - kill
        for kill, found in zip(run.kills, per_kill, strict=True)
        if (last := last_of(found)) is not None and last.marks.first_step is not None
    ]
    warnings = []
    short = [i + 1 for i, found in enumerate(per_kill) if len(found) < len(EXCLUSIVE_PODS)]
    if short:
        warnings.append(
            f"warning: kill(s) {', '.join(map(str, short))}: fewer than {len(EXCLUSIVE_PODS)} "
            f"replacements found for {', '.join(EXCLUSIVE_PODS)} (see --keep-logs)"
        )
    if world1["failures"] != len(run.kills) or len(recoveries) != len(run.kills):
        warnings.append(
            f"warning: {len(run.kills)} kills, but {BROKEN_WORLD} had {world1['failures']} failures and "
            f"{len(recoveries)} recoveries (a failure the bench did not cause, or overlapping "
            "recoveries: see --keep-logs)"
        )

    median_step = statistics.median(common.gaps(steps))
    windows = [(k, k + r + 1.0) for k, r in zip(run.kills, recoveries, strict=False)]
    worst, offset = common.worst_gap_in(steps, windows)
    quiet_windows = [(k - 2.0, k) for k in run.kills]
    quiet, _ = common.worst_gap_in(steps, quiet_windows)
    recovery = common.Spread.of(recoveries)
    figures = common.table(
        ["figure", "value"],
        [
            [
                "recoveries (min / median / max)",
                f"{recovery.min:.2f} / {recovery.median:.2f} / {recovery.max:.2f} s over {len(recoveries)} kills",
            ],
            [
                "replacements over all kills (runner: " + " ".join(f"--spares {c}" for c in args.spares) + ")",
                kinds(everyone),
            ],
            [
                "kill to the last replacement's first step (min / median / max)",
                " / ".join(ms(v) for v in common.Spread.of(to_first_step).as_dict().values()) if to_first_step else "-",
            ],
            [
                "python -c 'import torch' (median of runs)",
                f"{torch_import_s:.2f} s ({', '.join(f'{t:.2f}' for t in imports)})",
            ],
            [f"{UNAFFECTED} median step", common.fmt_s(median_step)],
            [
                f"{UNAFFECTED} worst gap in recovery windows / median",
                f"{worst / median_step:.2f} ({offset:+.2f} s after a kill)",
            ],
            [f"{UNAFFECTED} worst gap in the 2 s before kills / median", f"{quiet / median_step:.2f}"],
            [f"{UNAFFECTED} errors / failures", f"{world2['errors']} / {world2['failures']}"],
            [f"{BROKEN_WORLD} errors raised to the members", str(world1["errors"])],
            ["orphan processes", str(run.summary["orphans"])],
        ],
    )
    targets = [
        common.Target("median recovery", recovery.median, RECOVERY_LIMIT_S, " s"),
        common.Target(f"{UNAFFECTED} worst gap / median step", worst / median_step, GAP_LIMIT),
        common.Target(f"{UNAFFECTED} errors", world2["errors"], 0),
    ]
    notes = f"logs: {work} (runner.log, logs/<pod or spare>.log)" if args.keep_logs else ""
    common.report(
        "recovery: multiworld run, seed topology, --kill w1:1",
        load,
        [
            figures,
            "per kill (times from the kill; the stages are those of the replacement whose first step came "
            "last):\n" + breakdown,
            *warnings,
            *([notes] if notes else []),
        ],
        targets,
    )
    if not args.keep_logs:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        common.json_line(
            {
                "recovery_s": recovery.as_dict(),
                "torch_import_s": torch_import_s,
                "unaffected": {"worst_gap_ratio": worst / median_step, "errors": world2["errors"]},
            }
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [LAUNCH]:
        launch(argv[1:])
        return 0
    return coordinate(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
