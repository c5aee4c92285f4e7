"""Serving throughput through replica failures: examples/serving run by `multiworld run`.

The example's manifest with --replicas replicas (default 4: members replica1..N, one world per
replica with the router) runs twice, members at one compute thread each:
  capacity  --rate 0 (every request there at once): answers per second over the middle 80 %
            of the answers
  failures  at half that capacity; the runner SIGKILLs a replica every --every seconds
            (default 10), --kills times (default 5), a different replica each time (1, 2, ...,
            N, 1, ...), the first after --warmup + --steady seconds of the run
Clocks (wall clock, one machine):
  latency           from a request's scheduled arrival at the router to its answer received by
                    the router (router's trace)
  kill              when the runner logs its SIGKILL (its log is read here as it is written)
  back              when the router holds the replica's world at its new epoch (router's trace)
  steady            the --steady seconds (default 10) before the first kill; its figures are the
                    baseline
  during a failure  from each kill until its world is back
  dip               per kill, the longest run of 100 ms bins with fewer answers than (N-1)/N of
                    the steady rate that begins between the kill and the world's return; the
                    same measure over the steady window shows the machine's own noise
Lost and duplicate requests are counted from the router's trace (each request id once).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as common

MANIFEST = common.REPO / "examples" / "serving" / "multiworld.yaml"
NAME = "bench-serving"
ROUTER_POD = f"{NAME}-router-0"
BIN_S = 0.1
P99_RATIO_LIMIT = 3.0
DIP_LIMIT_S = 1.0
# The pod killed, or the warm spare playing it: "SIGKILL <spare> (playing <pod>)".
KILLED = re.compile(rf"injecting failure: SIGKILL (?:\S+ \(playing )?{NAME}-replica(\d+)-0")
# Added to a run's expected length for its cap, should it never end by itself: start-up and
# slow recoveries on a busy machine.
RUN_SLACK_S = 180.0


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--replicas", type=common.positive(int), default=None, help="replicas (default 4; 2 with --quick)")
    p.add_argument("--kills", type=common.positive(int), default=None, help="replica kills (default 5; 2 with --quick)")
    p.add_argument(
        "--every", type=common.positive(float), default=None, help="seconds between kills (default 10; 4 with --quick)"
    )
    p.add_argument(
        "--steady",
        type=common.positive(float),
        default=None,
        help="seconds of the steady window before the first kill (default 10; 3 with --quick)",
    )
    p.add_argument(
        "--warmup",
        type=common.positive(float),
        default=None,
        help="seconds after every world first ran before the steady window, while the runner "
        "starts its warm spares, one per replica (default 5; 3 with --quick)",
    )
    p.add_argument(
        "--capacity-requests",
        type=common.positive(int),
        default=None,
        help="requests of the capacity run (default 3000; 300 with --quick)",
    )
    p.add_argument(
        "--keep-logs", action="store_true", help="keep the members' logs and traces (their folder is printed)"
    )
    args = p.parse_args(argv)
    quick = args.quick
    args.replicas = args.replicas or (2 if quick else 4)
    if args.replicas < 2:
        p.error(f"--replicas: a failure needs another replica to serve, so at least 2, got {args.replicas}")
    args.kills = args.kills or (2 if quick else 5)
    args.every = args.every or (4.0 if quick else 10.0)
    args.steady = args.steady or (3.0 if quick else 10.0)
    args.warmup = args.warmup or (3.0 if quick else 5.0)
    args.capacity_requests = args.capacity_requests or (300 if quick else 3000)
    return args


# ---- running the manifest ----------------------------------------------------------------------


def write_manifest(path: Path, replicas: int, flags: list[str]) -> None:
    """The example's manifest with `replicas` replicas (a member and a world each, and one warm
    spare each: a replica is its world's only exclusive pod), the router's flags given."""
    import yaml

    doc = yaml.safe_load(MANIFEST.read_text())
    doc["metadata"]["name"] = NAME
    spec = doc["spec"]
    spec["members"] = [{"name": "router"}] + [{"name": f"replica{k}", "spares": 1} for k in range(1, replicas + 1)]
    spec["worlds"] = [{"name": f"world{k}", "ranks": ["router", f"replica{k}"]} for k in range(1, replicas + 1)]
    spec["template"]["spec"]["containers"][0]["args"] = flags
    path.write_text(yaml.safe_dump(doc))


@dataclass
class Run:
    summary: dict[str, Any]
    kills: list[tuple[float, int]] = field(default_factory=list)  # (unix time, replica) of each SIGKILL
    stderr: list[str] = field(default_factory=list)


def run_manifest(manifest: Path, log_dir: Path, kills: Sequence[tuple[float, int]], expected_s: float) -> Run:
    """`multiworld run` until the router has served every request and stopped the replicas;
    kills: (seconds after every world first ran, replica)."""
    cmd = [sys.executable, "-m", "multiworld_operator.cli", "run", str(manifest), "--json", "--no-view",
           "--log-dir", str(log_dir), "--workdir", str(common.REPO),
           "--duration", f"{expected_s + RUN_SLACK_S:g}"]  # fmt: skip
    for after, replica in kills:
        cmd += ["--kill", f"replica{replica}", "--after", f"{after:g}"]
    run = Run(summary={})

    def note_kill(line: str, _proc: subprocess.Popen[str]) -> None:
        if killed := KILLED.search(line):
            run.kills.append((time.time(), int(killed.group(1))))

    run.summary, run.stderr = common.run_local(cmd, note_kill, env={**os.environ, **common.MEMBER_ENV})
    return run


@dataclass(frozen=True)
class Trace:
    """The router's trace: its start, every answer, every break and return of a world."""

    start: float
    requests: int
    answers: list[dict[str, Any]]
    broke: list[dict[str, Any]]
    back: list[dict[str, Any]]
    end: dict[str, Any]

    @classmethod
    def read(cls, path: Path) -> Trace:
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for event in events:
            by_kind.setdefault(event["event"], []).append(event)
        if "start" not in by_kind or "end" not in by_kind:
            raise RuntimeError(f"the router's trace {path} has no start or no end: the router did not finish")
        start = by_kind["start"][-1]
        return cls(
            start=start["at"],
            requests=start["requests"],
            answers=by_kind.get("answer", []),
            broke=by_kind.get("broke", []),
            back=by_kind.get("back", []),
            end=by_kind["end"][-1],
        )

    @property
    def lost(self) -> int:
        return self.requests - len({a["id"] for a in self.answers})

    @property
    def duplicates(self) -> int:
        return len(self.answers) - len({a["id"] for a in self.answers})


def serve(
    args: Any, work: Path, label: str, flags: list[str], kills: Sequence[tuple[float, int]], expected_s: float
) -> tuple[Run, Trace]:
    trace_path = work / f"{label}.trace.jsonl"
    manifest = work / f"{label}.yaml"
    write_manifest(manifest, args.replicas, [*flags, "--trace", str(trace_path)])
    run = run_manifest(manifest, work / f"{label}-logs", kills, expected_s)
    (work / f"{label}-runner.log").write_text("\n".join(run.stderr) + "\n")
    return run, Trace.read(trace_path)


# ---- figures -------------------------------------------------------------------------------------


def p99(values: Sequence[float]) -> float:
    """nan for no values."""
    return common.p99(values) if values else math.nan


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def capacity(trace: Trace) -> float:
    """Answers per second over the middle 80 % of the answers."""
    done = sorted(a["done"] for a in trace.answers)
    low, high = len(done) // 10, len(done) - 1 - len(done) // 10
    return (high - low) / (done[high] - done[low])


def done_in(trace: Trace, windows: Sequence[tuple[float, float]]) -> list[dict[str, Any]]:
    return [a for a in trace.answers if any(start <= a["done"] < end for start, end in windows)]


def bins(trace: Trace) -> list[int]:
    """Answers per BIN_S bin from the router's start."""
    counts = Counter(int((a["done"] - trace.start) / BIN_S) for a in trace.answers)
    return [counts.get(i, 0) for i in range(max(counts, default=-1) + 1)]


def longest_dip(counts: list[int], floor: float, start: float, end: float, origin: float) -> float:
    """Seconds of the longest run of bins below `floor` that begins in [start, end) (times in
    seconds since `origin`); the run may go on past `end`."""
    first, last = int((start - origin) / BIN_S), int(math.ceil((end - origin) / BIN_S))
    longest, i = 0, first
    while i < min(last, len(counts)):
        if counts[i] >= floor:
            i += 1
            continue
        run_end = i
        while run_end < len(counts) and counts[run_end] < floor:
            run_end += 1
        longest = max(longest, run_end - i)
        i = run_end
    return longest * BIN_S


@dataclass(frozen=True)
class Failure:
    replica: int
    killed: float
    seen: float | None  # the router saw the world break
    back: float | None  # the router holds the world at its new epoch
    resent: int


def failures(run: Run, trace: Trace) -> list[Failure]:
    found = []
    for killed, replica in run.kills:
        world = f"world{replica}"
        broke = next((b for b in trace.broke if b["world"] == world and b["at"] >= killed), None)
        back = next((b["at"] for b in trace.back if b["world"] == world and b["at"] >= killed), None)
        found.append(Failure(replica, killed, broke["at"] if broke else None, back, broke["resent"] if broke else 0))
    return found


def ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.0f} ms"


def coordinate(args: Any) -> int:
    load = common.machine_load()
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    try:
        # Expected: ten seconds or so at the slowest this machine served.
        _, probe = serve(
            args,
            work,
            "capacity",
            ["--requests", str(args.capacity_requests), "--rate", "0"],
            [],
            args.capacity_requests / 50,
        )
        full = capacity(probe)
        rate = full / 2
        first = args.warmup + args.steady
        kills = [(first + i * args.every, i % args.replicas + 1) for i in range(args.kills)]
        # The stream goes on for a kill interval after the last kill.
        length = first + args.kills * args.every
        requests = math.ceil(rate * length)
        run, trace = serve(
            args, work, "failures", ["--requests", str(requests), "--rate", f"{rate:.3f}"], kills, length
        )
        present(args, load, full, rate, requests, run, trace)
    finally:
        if args.keep_logs:
            print(f"logs and traces: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def present(args: Any, load: str, full: float, rate: float, requests: int, run: Run, trace: Trace) -> None:
    failed = failures(run, trace)
    if not failed:
        raise RuntimeError("no kill was seen in the runner's log:\n" + "\n".join(run.stderr[-30:]))
    first_kill = failed[0].killed
    steady_window = (first_kill - args.steady, first_kill)
    steady = done_in(trace, [steady_window])
    steady_rps = len(steady) / args.steady
    last = max(a["done"] for a in trace.answers)
    windows = [(f.killed, f.back if f.back is not None else last) for f in failed]
    during = done_in(trace, windows)
    p99_steady = p99([a["done"] - a["arrived"] for a in steady])
    p99_failure = p99([a["done"] - a["arrived"] for a in during])
    resent = [a["done"] - a["arrived"] for a in trace.answers if a["attempts"] > 1]
    counts = bins(trace)
    floor = steady_rps * BIN_S * (args.replicas - 1) / args.replicas
    dips = [longest_dip(counts, floor, start, end, trace.start) for start, end in windows]
    steady_dip = longest_dip(counts, floor, *steady_window, trace.start)
    replicas_killed = [f.replica for f in failed]

    rows = []
    for i, (f, dip) in enumerate(zip(failed, dips, strict=True)):
        in_window = done_in(trace, [windows[i]])
        rows.append(
            [
                str(i + 1),
                f"replica{f.replica}",
                f"{f.killed - trace.start:.1f} s",
                ms(f.seen - f.killed if f.seen else None),
                str(f.resent),
                "-" if f.back is None else f"{f.back - f.killed:.2f} s",
                ms(p99([a["done"] - a["arrived"] for a in in_window])),
                f"{dip:.1f} s",
            ]
        )
    per_kill = common.table(
        ["kill", "replica", "at", "router saw it", "re-sent", "world back after", "p99 in window", "dip"], rows
    )
    figures = common.table(
        ["figure", "value"],
        [
            ["capacity (--rate 0, middle 80 % of answers)", f"{full:.1f} req/s with {args.replicas} replicas"],
            ["offered rate (half the capacity)", f"{rate:.1f} req/s, {requests} requests"],
            [f"steady throughput ({args.steady:g} s before the first kill)", f"{steady_rps:.1f} req/s"],
            ["p99 latency: steady (baseline) / during failures", f"{ms(p99_steady)} / {ms(p99_failure)}"],
            [
                "p99 during failures, re-sent requests left out",
                ms(p99([a["done"] - a["arrived"] for a in during if a["attempts"] == 1])),
            ],
            ["re-sent requests' latency: median / max", f"{ms(median(resent))} / {ms(max(resent, default=math.nan))}"],
            [
                f"longest dip below {args.replicas - 1}/{args.replicas} of steady: steady window (baseline) / kills",
                f"{steady_dip:.1f} s / {max(dips):.1f} s",
            ],
            [
                "answers / re-sent (retried) / lost / duplicates",
                f"{len(trace.answers)} / {trace.end['retried']} / {trace.lost} / {trace.duplicates}",
            ],
            ["answers checked against the model / wrong", f"{trace.end['checked']} / {trace.end['wrong']}"],
            ["orphan processes", str(run.summary["orphans"])],
        ],
    )
    distinct = all(a != b for a, b in zip(replicas_killed, replicas_killed[1:], strict=False))
    targets = [
        common.Target("lost requests", trace.lost, 0),
        common.Target("duplicate answers", trace.duplicates, 0),
        common.Target("wrong answers", trace.end["wrong"], 0),
        common.Target("p99 during failures / steady p99", p99_failure / p99_steady, P99_RATIO_LIMIT),
        common.Target("longest dip of any kill", max(dips), DIP_LIMIT_S, " s"),
        common.Target(
            "kills missing, or the same replica twice running", (args.kills - len(failed)) + (0 if distinct else 1), 0
        ),
        common.Target("killed replicas' worlds not back", sum(f.back is None for f in failed), 0),
    ]
    common.report(
        f"serving: examples/serving, {args.replicas} replicas, a replica killed every {args.every:g} s",
        load,
        [figures, "per kill (times from the kill):\n" + per_kill],
        targets,
    )
    if args.json:
        common.json_line(
            {
                "steady_rps": steady_rps,
                "lost": trace.lost,
                "duplicates": trace.duplicates,
                "p99_ms": {"steady": p99_steady * 1e3, "during_failure": p99_failure * 1e3},
                "dip_s": max(dips),
            }
        )


def main(argv: Sequence[str] | None = None) -> int:
    return coordinate(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
