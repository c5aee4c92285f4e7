"""Serving throughput through replica failures, or a rollout: examples/serving run by `multiworld run`.

The example's manifest with --replicas replicas (default 4: members replica1..N, each with its
own copy of the template and one warm spare, one world per replica with the router) runs twice,
members at one compute thread each:
  capacity  --rate 0 (every request there at once): answers per second over the middle 80 %
            of the answers
  failures  at half that capacity; the runner SIGKILLs a replica every --every seconds
            (default 10), --kills times (default 5), a different replica each time (1, 2, ...,
            N, 1, ...), the first after --warmup + --steady seconds of the run
  rollout   (--rollout, in place of the failures run) at half that capacity; at the first kill's
            time (--warmup + --steady seconds after every world first ran) the bench rewrites the
            run's manifest file, adding the env var ROLLOUT=1 to every replica member's template
            (not the router's); `multiworld run` applies the edit and rolls it out pod by pod
            (spec.updateStrategy's defaults, maxUnavailable 1 and maxSurge 1: the new template's
            spares start one at a time, and each replica pod is replaced by a ready one and its
            world moves one epoch). The stream goes
            on for (N + 1) x --every seconds after the edit. The same figures as for kills, with
            each replaced replica a "rollout event" in place of a kill.
Clocks (wall clock, one machine):
  latency           from a request's scheduled arrival at the router to its answer received by
                    the router (router's trace)
  kill              when the runner logs its SIGKILL (its log is read here as it is written)
  edit              starts when the bench has replaced the manifest file (an atomic rename), at
                    --warmup + --steady seconds after it read the runner's last `WorldReady`
                    line of epoch 1 (every world first ran: the runner's own clock for kills
                    starts then, within its 0.5 s tick); the runner reads the file at its next
                    tick and logs "manifest edited: applying it"
  replaced          per replica, when the runner logs `PodUpdated: pod P replaced by one of
                    member replicaK's new template` (read as written, like a kill), or when the
                    router saw the replica's world break at the epoch it left, if that came
                    first: the runner logs the line only after it stopped the old pod and
                    published the world's new epoch (the epoch is its `WorldUpdating` line's)
  back              when the router holds the replica's world at its new epoch (router's trace):
                    after a kill, its first `back` after the kill's line; after a replacement,
                    its `back` at the epoch the `WorldUpdating` line names
  steady            the --steady seconds (default 10) before the first kill, or before the edit;
                    its figures are the baseline
  during failures   from each kill until its world is back
  during rollout    one window: from the edit until the last replaced replica's world is back
                    (the new template's spares starting are in it); until the last answer when
                    a replica was not replaced or its world not back; its two phases apart:
                    the edit until the first replacement (the new pods starting), then until
                    the last world is back (the replacements)
  dip               per kill or replaced replica, the longest run of 100 ms bins with fewer
                    answers than (N-1)/N of the steady rate that begins between the kill (the
                    replacement) and the world's return; the same measure over the steady
                    window shows the machine's own noise, and over the whole rollout window
                    whatever the rollout costs outside the replacements
  throughput        answers received by the router within the window(s), over their length
Lost and duplicate requests are counted from the router's trace (each request id once).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import bench_common as common

MANIFEST = common.REPO / "examples" / "serving" / "multiworld.yaml"
NAME = "bench-serving"
ROUTER_POD = f"{NAME}-router-0"
BIN_S = 0.1
P99_RATIO_LIMIT = 3.0
DIP_LIMIT_S = 1.0
# The pod killed, or the warm spare playing it: "SIGKILL <spare> (playing <pod>)".
KILLED = re.compile(rf"injecting failure: SIGKILL (?:\S+ \(playing )?{NAME}-replica(\d+)-0")
# A replica's pod (or the spare playing it) replaced in the rollout.
UPDATED = re.compile(r"PodUpdated: pod \S+ replaced by one of member replica(\d+)'s new template")
# Its world's new epoch: the line that follows.
UPDATING = re.compile(r"WorldUpdating: world world(\d+) moves to epoch (\d+) for the rollout")
# A world first running: when every world has, the runner's fault clock starts.
READY = re.compile(r"WorldReady: world (\S+) ready with all \d+ ranks at epoch 1\b")
# What the rollout changes in every replica member's template.
ROLLOUT_ENV = {"name": "ROLLOUT", "value": "1"}
# Added to a run's expected length for its cap, should it never end by itself: start-up and
# slow recoveries on a busy machine.
RUN_SLACK_S = 180.0


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.setting("--replicas", int, 4, 2, "replicas")
    p.add_argument("--kills", type=common.positive(int), default=None, help="replica kills (default 5; 2 with --quick)")
    p.setting(
        "--every",
        float,
        10.0,
        4.0,
        "seconds between kills; with --rollout the stream goes on for (replicas + 1) times this after the edit",
    )
    p.add_argument(
        "--rollout",
        action="store_true",
        help="instead of kills, edit every replica's template at the first kill's time (a rollout pod by pod)",
    )
    p.setting("--steady", float, 10.0, 3.0, "seconds of the steady window before the first kill")
    p.setting(
        "--warmup",
        float,
        5.0,
        3.0,
        "seconds after every world first ran before the steady window, while the runner starts its warm spares, "
        "one per replica",
    )
    p.setting("--capacity-requests", int, 3000, 300, "requests of the capacity run")
    p.add_argument(
        "--keep-logs", action="store_true", help="keep the members' logs and traces (their folder is printed)"
    )
    args = p.parse_args(argv)
    if args.rollout and args.kills is not None:
        p.error("--kills and --rollout: a rollout run has no kills")
    if args.replicas < 2:
        p.error(f"--replicas: a failure needs another replica to serve, so at least 2, got {args.replicas}")
    args.kills = args.kills or (2 if args.quick else 5)
    return args


# ---- running the manifest ----------------------------------------------------------------------


def write_manifest(path: Path, replicas: int, flags: list[str]) -> None:
    """The example's manifest with `replicas` replicas (a member and a world each, and one warm
    spare each: a replica is its world's only exclusive pod), the router's flags given. Each
    replica member has its own copy of the template, so that a rollout can change the replicas'
    and not the router's."""
    import yaml

    doc = yaml.safe_load(MANIFEST.read_text())
    doc["metadata"]["name"] = NAME
    spec = doc["spec"]
    spec["template"]["spec"]["containers"][0]["args"] = flags
    spec["members"] = [{"name": "router"}] + [
        {"name": f"replica{k}", "spares": 1, "template": copy.deepcopy(spec["template"])}
        for k in range(1, replicas + 1)
    ]
    spec["worlds"] = [{"name": f"world{k}", "ranks": ["router", f"replica{k}"]} for k in range(1, replicas + 1)]
    path.write_text(yaml.safe_dump(doc))


def roll_out(path: Path) -> None:
    """Edit the manifest as `kubectl apply` would: ROLLOUT_ENV in every replica member's
    template. Written beside it and renamed over it, so the runner never reads half a file."""
    import yaml

    doc = yaml.safe_load(path.read_text())
    for member in doc["spec"]["members"]:
        if member["name"].startswith("replica"):
            member["template"]["spec"]["containers"][0].setdefault("env", []).append(dict(ROLLOUT_ENV))
    edited = path.with_name(path.name + ".edited")
    edited.write_text(yaml.safe_dump(doc))
    os.replace(edited, path)


@dataclass
class Run:
    summary: dict[str, Any]
    # (unix time, replica, its world's new epoch if logged) of each event: a SIGKILL, or a pod
    # replaced in the rollout
    events: list[tuple[float, int, int | None]] = field(default_factory=list)
    edited: float | None = None  # unix time the manifest was edited (--rollout)
    stderr: list[str] = field(default_factory=list)


def run_manifest(
    manifest: Path,
    log_dir: Path,
    kills: Sequence[tuple[float, int]],
    expected_s: float,
    rollout_after: float | None = None,
    worlds: int = 0,
) -> Run:
    """`multiworld run` until the router has served every request and stopped the replicas;
    kills: (seconds after every world first ran, replica); rollout_after: seconds after the
    `worlds` worlds first ran when the manifest is edited (roll_out)."""
    cmd = [sys.executable, "-m", "multiworld_operator.cli", "run", str(manifest), "--json", "--no-view",
           "--log-dir", str(log_dir), "--workdir", str(common.REPO),
           "--duration", f"{expected_s + RUN_SLACK_S:g}"]  # fmt: skip
    for after, replica in kills:
        cmd += ["--kill", f"replica{replica}", "--after", f"{after:g}"]
    run = Run(summary={})
    ready: set[str] = set()
    timer: threading.Timer | None = None

    def edit() -> None:
        roll_out(manifest)
        run.edited = time.time()

    def note(line: str, _proc: subprocess.Popen[str]) -> None:
        nonlocal timer
        if event := KILLED.search(line) or UPDATED.search(line):
            run.events.append((time.time(), int(event.group(1)), None))
        elif updating := UPDATING.search(line):
            replica, epoch = int(updating.group(1)), int(updating.group(2))
            i = max((i for i, e in enumerate(run.events) if e[1] == replica and e[2] is None), default=None)
            if i is not None:
                run.events[i] = (run.events[i][0], replica, epoch)
        elif rollout_after is not None and (up := READY.search(line)):
            ready.add(up.group(1))
            if len(ready) == worlds and timer is None:
                timer = threading.Timer(rollout_after, edit)
                timer.daemon = True
                timer.start()

    try:
        run.summary, run.stderr = common.run_local(cmd, note, env={**os.environ, **common.MEMBER_ENV})
    finally:
        if timer is not None:
            timer.cancel()
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
    args: Any,
    work: Path,
    label: str,
    flags: list[str],
    kills: Sequence[tuple[float, int]],
    expected_s: float,
    rollout_after: float | None = None,
) -> tuple[Run, Trace]:
    trace_path = work / f"{label}.trace.jsonl"
    manifest = work / f"{label}.yaml"
    write_manifest(manifest, args.replicas, [*flags, "--trace", str(trace_path)])
    run = run_manifest(manifest, work / f"{label}-logs", kills, expected_s, rollout_after, args.replicas)
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


def covered(windows: Sequence[tuple[float, float]]) -> float:
    """Seconds in the union of the windows."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(windows):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def rps(trace: Trace, windows: Sequence[tuple[float, float]]) -> float:
    """Answers per second within the windows; nan for windows of no length."""
    length = covered(windows)
    return len(done_in(trace, windows)) / length if length > 0 else math.nan


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
class Disruption:
    """A kill, or a replica pod replaced in the rollout."""

    replica: int
    at: float  # the runner logged the kill; the pod replaced (logged, or its world broke if earlier)
    seen: float | None  # the router saw the world break
    back: float | None  # the router holds the world at its new epoch
    resent: int


def disruptions(run: Run, trace: Trace) -> list[Disruption]:
    """A kill's world breaks and comes back after its line; a replaced pod's world leaves the
    epoch before the one its WorldUpdating line names and comes back at that one. The runner
    logs PodUpdated after it has stopped the pod and published the world's new epoch, so the
    router may see the break first: the replacement then starts at the router's break."""
    found = []
    for logged, replica, epoch in run.events:
        world = f"world{replica}"
        if epoch is None:
            broke = next((b for b in trace.broke if b["world"] == world and b["at"] >= logged), None)
            back = next((b["at"] for b in trace.back if b["world"] == world and b["at"] >= logged), None)
        else:
            broke = next((b for b in trace.broke if b["world"] == world and b["epoch"] == epoch - 1), None)
            back = next((b["at"] for b in trace.back if b["world"] == world and b["epoch"] == epoch), None)
        at = min(logged, broke["at"]) if broke and epoch is not None else logged
        found.append(Disruption(replica, at, broke["at"] if broke else None, back, broke["resent"] if broke else 0))
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
        if args.rollout:
            kills = []
            # The new template's spares start, then the replicas are replaced one by one.
            length = first + (args.replicas + 1) * args.every
        else:
            kills = [(first + i * args.every, i % args.replicas + 1) for i in range(args.kills)]
            # The stream goes on for a kill interval after the last kill.
            length = first + args.kills * args.every
        requests = math.ceil(rate * length)
        run, trace = serve(
            args,
            work,
            "rollout" if args.rollout else "failures",
            ["--requests", str(requests), "--rate", f"{rate:.3f}"],
            kills,
            length,
            first if args.rollout else None,
        )
        present(args, load, full, rate, requests, run, trace)
    finally:
        if args.keep_logs:
            print(f"logs and traces: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def present(args: Any, load: str, full: float, rate: float, requests: int, run: Run, trace: Trace) -> None:
    """The failures run's figures, or the rollout's: each replaced replica plays a kill."""
    found = disruptions(run, trace)
    event, during_what = ("replaced", "the rollout") if args.rollout else ("kill", "failures")
    if not found:
        raise RuntimeError(f"no {event} was seen in the runner's log:\n" + "\n".join(run.stderr[-30:]))
    if args.rollout and run.edited is None:
        raise RuntimeError(
            "the manifest was never edited (no WorldReady of every world?):\n" + "\n".join(run.stderr[-30:])
        )
    start = run.edited if run.edited is not None else found[0].at
    steady_window = (start - args.steady, start)
    steady = done_in(trace, [steady_window])
    steady_rps = len(steady) / args.steady
    last = max(a["done"] for a in trace.answers)
    windows = [(f.at, f.back if f.back is not None else last) for f in found]
    replaced = Counter(f.replica for f in found)
    # The rollout's window: from the edit until every replica's world is back after its pod was
    # replaced (until the last answer when one was not).
    complete = set(replaced) == set(range(1, args.replicas + 1)) and all(f.back is not None for f in found)
    rollout_window = (start, max(end for _, end in windows) if complete else last)
    during_windows = [rollout_window] if args.rollout else windows
    during = done_in(trace, during_windows)
    during_rps = rps(trace, during_windows)
    p99_steady = p99([a["done"] - a["arrived"] for a in steady])
    p99_during = p99([a["done"] - a["arrived"] for a in during])
    resent = [a["done"] - a["arrived"] for a in trace.answers if a["attempts"] > 1]
    counts = bins(trace)
    floor = steady_rps * BIN_S * (args.replicas - 1) / args.replicas
    dips = [longest_dip(counts, floor, begin, end, trace.start) for begin, end in windows]
    steady_dip = longest_dip(counts, floor, *steady_window, trace.start)
    window_dip = longest_dip(counts, floor, *rollout_window, trace.start)
    restarts = sum(w["failures"] for w in run.summary["worlds"].values())

    rows = []
    for i, (f, dip) in enumerate(zip(found, dips, strict=True)):
        in_window = done_in(trace, [windows[i]])
        rows.append(
            [
                str(i + 1),
                f"replica{f.replica}",
                f"{f.at - trace.start:.1f} s" + (f" (edit +{f.at - start:.1f} s)" if args.rollout else ""),
                ms(f.seen - f.at if f.seen else None),
                str(f.resent),
                "-" if f.back is None else f"{f.back - f.at:.2f} s",
                ms(p99([a["done"] - a["arrived"] for a in in_window])),
                f"{dip:.1f} s",
            ]
        )
    per_event = common.table(
        [event, "replica", "at", "router saw it", "re-sent", "world back after", "p99 in window", "dip"], rows
    )
    before = "the edit" if args.rollout else "the first kill"
    lines = [
        ["capacity (--rate 0, middle 80 % of answers)", f"{full:.1f} req/s with {args.replicas} replicas"],
        ["offered rate (half the capacity)", f"{rate:.1f} req/s, {requests} requests"],
    ]
    if args.rollout:
        # The rollout's two phases: its new pods (spares of the new template) start, then the
        # replacements.
        first = min(f.at for f in found)
        starting = p99([a["done"] - a["arrived"] for a in done_in(trace, [(start, first)])])
        replacing = p99([a["done"] - a["arrived"] for a in done_in(trace, [(first, rollout_window[1])])])
        lines += [
            [
                "rollout window (edit until the last replaced replica's world is back)",
                f"{rollout_window[1] - rollout_window[0]:.2f} s" + ("" if complete else " (incomplete)"),
            ],
            [
                "p99: edit until the first replacement / first replacement until the last world is back",
                f"{ms(starting)} ({first - start:.2f} s) / {ms(replacing)} ({rollout_window[1] - first:.2f} s)",
            ],
        ]
    lines += [
        [f"throughput: steady ({args.steady:g} s before {before}) / during {during_what}",
         f"{steady_rps:.1f} req/s / {during_rps:.1f} req/s"],
        [f"p99 latency: steady (baseline) / during {during_what}", f"{ms(p99_steady)} / {ms(p99_during)}"],
        [
            f"p99 during {during_what}, re-sent requests left out",
            ms(p99([a["done"] - a["arrived"] for a in during if a["attempts"] == 1])),
        ],
        ["re-sent requests' latency: median / max", f"{ms(median(resent))} / {ms(max(resent, default=math.nan))}"],
        [
            f"longest dip below {args.replicas - 1}/{args.replicas} of steady: steady window (baseline) / "
            + ("replaced replicas / whole rollout window" if args.rollout else "kills"),
            f"{steady_dip:.1f} s / {max(dips):.1f} s" + (f" / {window_dip:.1f} s" if args.rollout else ""),
        ],
        [
            "answers / re-sent (retried) / lost / duplicates",
            f"{len(trace.answers)} / {trace.end['retried']} / {trace.lost} / {trace.duplicates}",
        ],
        ["answers checked against the model / wrong", f"{trace.end['checked']} / {trace.end['wrong']}"],
        ["restarts counted by the runner (failures in its summary)", str(restarts)],
        ["orphan processes", str(run.summary["orphans"])],
    ]  # fmt: skip
    figures = common.table(["figure", "value"], lines)
    targets = [
        common.Target("lost requests", trace.lost, 0),
        common.Target("duplicate answers", trace.duplicates, 0),
        common.Target("wrong answers", trace.end["wrong"], 0),
        common.Target(f"p99 during {during_what} / steady p99", p99_during / p99_steady, P99_RATIO_LIMIT),
        common.Target(
            f"longest dip of any {'replaced replica' if args.rollout else 'kill'}", max(dips), DIP_LIMIT_S, " s"
        ),
    ]
    if args.rollout:
        targets += [
            common.Target(
                "replicas not replaced exactly once",
                sum(abs(replaced[k] - 1) for k in range(1, args.replicas + 1))
                + sum(k > args.replicas for k in replaced),
                0,
            ),
            common.Target("replaced replicas' worlds not back", sum(f.back is None for f in found), 0),
            common.Target("restarts counted for the rollout", restarts, 0),
        ]
        title = f"serving: examples/serving, {args.replicas} replicas, a rollout of every replica's template"
    else:
        killed = [f.replica for f in found]
        distinct = all(a != b for a, b in zip(killed, killed[1:], strict=False))
        targets += [
            common.Target(
                "kills missing, or the same replica twice running",
                (args.kills - len(found)) + (0 if distinct else 1),
                0,
            ),
            common.Target("killed replicas' worlds not back", sum(f.back is None for f in found), 0),
        ]
        title = f"serving: examples/serving, {args.replicas} replicas, a replica killed every {args.every:g} s"
    what = (
        "per replaced replica (times from its replacement: the PodUpdated line, or the router's break if earlier)"
        if args.rollout
        else "per kill (times from the kill)"
    )
    common.report(title, load, [figures, f"{what}:\n" + per_event], targets)
    if args.json:
        results: dict[str, Any] = {
            "steady_rps": steady_rps,
            "lost": trace.lost,
            "duplicates": trace.duplicates,
            "p99_ms": {
                "steady": p99_steady * 1e3,
                ("during_rollout" if args.rollout else "during_failure"): p99_during * 1e3,
            },
            "dip_s": max(dips),
        }
        if args.rollout:
            results["rollout"] = {
                "replaced": len(found),
                "window_s": rollout_window[1] - rollout_window[0],
                "complete": complete,
                "during_rps": during_rps,
                "window_dip_s": window_dip,
                "restarts": restarts,
                "per_replica": [
                    {"replica": f.replica, "back_s": None if f.back is None else f.back - f.at, "dip_s": dip}
                    for f, dip in zip(found, dips, strict=True)
                ],
            }
        common.json_line(results)


def main(argv: Sequence[str] | None = None) -> int:
    return coordinate(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
