"""Failure detection latency, false verdicts on saturated cores, and what a failure costs
another world of the same process.

Two phases in one run: a baseline, then the same again with --load N busy processes beside the
worlds (--load 0: the baseline only). The load processes alternate between a pure-Python loop
and a torch matmul loop on one thread; they are children of this process and in its session,
as the members are (where the kernel groups processes by session, autogroup, they compete with
the members inside one group, not from groups of their own). Each phase:

1. Detection. A survivor process holds a long-lived world "other" (with a peer process) that
   steps an all_reduce about every 20 ms, and, trial after trial, a fresh two-rank world with a
   victim process, which is then:
     crash_busy   SIGKILLed during a stream of all_reduces (the survivor is rank 0)
     crash_idle   SIGKILLed with no op in flight (the survivor is rank 0)
     frozen       SIGSTOPped during a stream of all_reduces (the survivor is rank 0)
     frozen_host  SIGSTOPped while it is rank 0, the world's store host, no op in flight
     store_host   SIGKILLed while it is rank 0, no op in flight
   The clock starts in this process just before os.kill and stops at the wall time at which
   the survivor caught the WorldBrokenError (an idle survivor polls `world.broken` every
   millisecond, then its next op raises); one machine, one clock. crash_idle, frozen and
   frozen_host are silent peers, heard only through the heartbeats and the stall watch (a
   node that loses its power or its network looks so: no connection is reset). Victims are
   forked from a process that has already imported torch, so a trial does not wait for an
   import. For "other": its worst step gap inside the failure windows (signal to detection
   + --after-s) over its median step in the phase, and the errors it raised in either of its
   processes; the same ratio in equally long quiet windows just before each signal shows the
   machine's own noise. A trial world that breaks before its fault is a false verdict ("in
   trials") and no latency.
2. False verdicts. Three fresh soak processes join 7 worlds (one each way between every two of
   them, alternately busy and idle, and one busy world of all three) and run with no fault
   injected anywhere. The clock starts once all three have joined every world and stops
   --soak-s later, when they are told to stop; each then reports when and why each of its
   worlds broke (every verdict is false: "false verdicts" inside the clock, "while joining"
   before it, a join that failed included: a soak world's join gives up after
   SOAK_JOIN_TIMEOUT_S) and its failure detector's figures since it started
   (WorldManager.heartbeat_load): the longest silence its judges measured, on their own
   clocks (the margin left below dead_after), their late readings and the verdicts
   confirmation reads called off. With --gil-hog each soak process also runs a pure-Python
   busy thread of its own, which its beating threads wait on for the GIL (a program's own
   Python compute).
The load processes' CPU (user + system time from /proc/<pid>/stat, from the moment all were
busy to the phase's end) says how many cores they took; the machine's load average says what
else ran. Joins are counted apart because torch's own store server looks up the name of every
client that connects, on the thread that serves all its clients: where that lookup went to a
slow DNS server, the store answered nobody until it ended and its peers heard silence (one in
fifty took 5 s on the machine these figures were first taken on; the stores are this library's
own since, store/server.py, which looks nothing up). Detection settings come from
the MULTIWORLD_* environment (defaults as shipped).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from multiworld.detect.config import DetectConfig
from tests.support import bench_common as common
from tests.support.cpu_load import BusyProcesses
from tests.support.members import MemberFailed

SCENARIOS = ("crash_busy", "crash_idle", "frozen", "frozen_host", "store_host")
# The victim is silent: no connection is reset, only the heartbeats (or the stall watch) hear it.
SILENT = ("crash_idle", "frozen", "frozen_host")
# (survivor rank, busy, signal) per scenario; the victim holds the other rank of two.
SETUP = {
    "crash_busy": (0, True, signal.SIGKILL),
    "crash_idle": (0, False, signal.SIGKILL),
    "frozen": (0, True, signal.SIGSTOP),
    "frozen_host": (1, False, signal.SIGSTOP),
    "store_host": (1, False, signal.SIGKILL),
}
STEP_SLEEP_S = 0.02
STREAMING_AFTER = 20  # ops of the busy stream before a trial counts as streaming
IDLE_POLL_S = 0.001
VERDICT_POLL_S = 0.01
DETECT_WAIT_S = 60.0
# Baseline targets: an op error within 0.1 s; a silent peer within 0.5 s (issue 34).
TARGETS = {"crash_busy": 0.1, "crash_idle": 0.5, "frozen": 0.5, "frozen_host": 0.5}
GAP_LIMIT = 3.0
SOAKERS = 3
# A soak world whose join failed on one side (a verdict while joining) fails on the others after
# this, instead of the default 300 s, so that the soak goes on and counts it (within the
# coordinator's wait for every join, bench_common.MEMBER_WAIT_S).
SOAK_JOIN_TIMEOUT_S = 60.0
# gloo's source location in its error messages: noise in a table.
SOURCE_LOCATION = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ?")


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.setting("--trials", int, 5, 1, "trials per scenario and phase")
    p.setting("--quiet-s", float, 1.0, 0.5, "seconds of steady state before each signal, also the quiet window")
    p.setting("--after-s", float, 1.0, 0.5, "seconds after each detection that still count as the failure window")
    p.setting("--soak-s", float, 60.0, 5.0, "seconds of the soak with no fault, per phase")
    p.add_argument(
        "--load",
        type=int,
        default=None,
        help="busy processes in the second phase; 0: the baseline only (default 4; 2 with --quick)",
    )
    p.add_argument("--gil-hog", action="store_true", help="each soak process also runs a pure-Python busy thread")
    p.add_argument("--member", choices=["survivor", "peer", "spawner", "soaker"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.load is None:
        args.load = 2 if args.quick else 4
    if args.load < 0:
        p.error(f"--load must be >= 0, got {args.load}")
    return args


# ---- the member side -------------------------------------------------------------------------


def assignment(name: str, rank: int, port: int, size: int = 2) -> Any:
    import multiworld as mw

    return mw.WorldAssignment(name=name, rank=rank, size=size, host="127.0.0.1", port=port)


def manager(pod: str, join_timeout: float | None = None) -> Any:
    """A manager with the MULTIWORLD_* settings; `join_timeout` in place of theirs if given."""
    import torch

    import multiworld as mw

    torch.set_num_threads(1)
    config = mw.DetectConfig.from_env()
    if join_timeout is not None:
        config = mw.DetectConfig(**{**config.model_dump(), "join_timeout": join_timeout})
    return mw.WorldManager(pod=pod, config=config)


class Stepper:
    """A world's loop on its own thread: one small all_reduce, then a short sleep."""

    def __init__(self, world: Any, sleep_s: float) -> None:
        self.world = world
        self.sleep_s = sleep_s
        self.times: list[float] = []
        self.errors = 0
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join(60)

    def _run(self) -> None:
        import torch

        import multiworld as mw

        tensor = torch.ones(4)
        while not self.stopping.is_set():
            try:
                self.world.all_reduce(tensor)
            except mw.WorldBrokenError as exc:
                if not self.stopping.is_set():
                    self.errors += 1
                    common.emit("step_broken", world=self.world.name, reason=exc.reason)
                return
            self.times.append(time.time())
            if self.sleep_s:
                time.sleep(self.sleep_s)


def until_broken(world: Any, busy: bool) -> Any:
    """Run the trial world until it breaks; the WorldBrokenError raised here."""
    import torch

    import multiworld as mw

    tensor = torch.ones(4)
    ops = 0
    try:
        while True:
            if busy:
                world.all_reduce(tensor)
                ops += 1
                if ops == STREAMING_AFTER:
                    common.emit("streaming", world=world.name)
            elif world.broken:
                world.barrier()  # raises at once
            else:
                time.sleep(IDLE_POLL_S)
    except mw.WorldBrokenError as exc:
        return exc


def survivor(port: int) -> None:
    mgr = manager("survivor")
    stepper = Stepper(mgr.join(assignment("other", 0, port)), STEP_SLEEP_S)
    stepper.start()
    common.emit("ready")
    for command in common.commands():
        if command["cmd"] == "stop":
            break
        name = command["world"]
        join_started = time.time()
        world = mgr.join(assignment(name, command["rank"], command["port"]))
        common.emit("joined", world=name, started=join_started)
        error = until_broken(world, command["busy"])
        common.emit("broken", world=name, reason=error.reason)
        mgr.leave(name)
    # The peer goes on stepping, so this last step completes; the peer stops after this.
    stepper.stop()
    common.emit("other", times=stepper.times, errors=stepper.errors)
    for _ in common.commands():  # until told to exit, so the peer never sees this process leave
        break
    mgr.close()


def peer(port: int) -> None:
    mgr = manager("peer")
    stepper = Stepper(mgr.join(assignment("other", 1, port)), 0.0)
    stepper.start()
    for _ in common.commands():  # stop
        break
    stepper.stopping.set()
    mgr.close()  # ends the step the survivor no longer answers; not an error once stopping
    stepper.stop()
    common.emit("stopped", errors=stepper.errors)


def spawner() -> None:
    """Forks victims on command, from a process with torch and multiworld imported but no
    thread started (so forking is safe)."""
    import torch  # noqa: F401

    import multiworld  # noqa: F401

    common.emit("ready")
    for command in common.commands():
        while True:  # reap the victims that died in earlier trials
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if os.fork() == 0:
            try:
                victim(command)
            finally:
                os._exit(0)


def victim(command: dict[str, Any]) -> None:
    mgr = manager(f"victim-{command['world']}")
    world = mgr.join(assignment(command["world"], command["rank"], command["port"]))
    common.emit("victim_joined", world=command["world"], pid=os.getpid())
    if command["busy"]:
        until_broken(world, True)
    else:
        while True:
            time.sleep(1)


def hog(stopping: threading.Event) -> None:
    """Pure Python: it holds the GIL but for the interpreter's forced switches."""
    count = 0
    while not stopping.is_set():
        count += 1


def watch_verdicts(worlds: dict[str, Any], broken: dict[str, tuple[float, str]], stopping: threading.Event) -> None:
    """When each world broke, and why (polled every VERDICT_POLL_S)."""
    while not stopping.wait(VERDICT_POLL_S):
        for name, world in worlds.items():
            if name not in broken and world.error is not None:
                broken[name] = (time.time(), world.error.reason)


def soaker() -> None:
    """Joins the worlds it is told, steps the busy ones, and on `stop` says what broke and how
    near its failure detector came to a verdict; leaves on `exit`."""
    commands = iter(common.commands())
    told = next(commands)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")  # on stderr
    mgr = manager(f"soak-{os.getpid()}", SOAK_JOIN_TIMEOUT_S)
    worlds = mgr.join_all([assignment(w["name"], w["rank"], w["port"], w["size"]) for w in told["worlds"]])
    joined_at = time.time()
    # A join that failed (it says why on stderr) is a verdict too: a member judged silent; so is
    # a world already broken when its join returned. Both are timed here, before this process
    # says it joined (the soak's clock starts after), and so count as verdicts while joining.
    broken = {w["name"]: (joined_at, "could not join") for w in told["worlds"] if w["name"] not in worlds}
    broken.update({name: (joined_at, w.error.reason) for name, w in worlds.items() if w.error is not None})
    steppers = [Stepper(worlds[w["name"]], STEP_SLEEP_S) for w in told["worlds"] if w["busy"] and w["name"] in worlds]
    stopping = threading.Event()
    threads = [threading.Thread(target=watch_verdicts, args=(worlds, broken, stopping), daemon=True)]
    if told["gil_hog"]:
        threads.append(threading.Thread(target=hog, args=(stopping,), daemon=True))
    for stepper in steppers:
        stepper.start()
    for thread in threads:
        thread.start()
    common.emit("joined", worlds=sorted(worlds))
    next(commands)  # stop
    load = mgr.heartbeat_load()
    common.emit(
        "soaked",
        verdicts={name: {"at": at, "reason": reason} for name, (at, reason) in broken.items()},
        steps=sum(len(s.times) for s in steppers),
        longest_silence=load.longest_silence,
        late_readings=load.late_readings,
        called_off=load.called_off,
    )
    next(commands)  # exit: every soak process has reported, so a leave here is no false verdict
    stopping.set()
    for stepper in steppers:
        stepper.stopping.set()
    mgr.close()


# ---- the coordinator -------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    scenario: str
    signalled: float
    detected: float
    reason: str
    # The world broke before its fault (a false verdict): no latency to count.
    spoiled: bool = False

    @property
    def latency(self) -> float:
        return self.detected - self.signalled


@dataclass(frozen=True)
class Soak:
    seconds: float
    worlds: int
    # False verdicts once every soak process had joined every world (the soak's clock), and
    # before: while worlds were still being joined.
    verdicts: dict[str, str]
    joining: dict[str, str]
    longest_silence: float
    late_readings: int
    called_off: int
    steps: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "worlds": self.worlds,
            "false_verdicts": len(self.verdicts),
            "false_verdicts_joining": len(self.joining),
            "longest_silence_s": self.longest_silence,
            "late_readings": self.late_readings,
            "called_off": self.called_off,
        }


@dataclass(frozen=True)
class Phase:
    name: str
    load: int
    started: float
    ended: float
    trials: list[Trial]
    soak: Soak
    load_cores: float
    machine: str

    @property
    def spoiled(self) -> dict[str, str]:
        """The trial worlds that broke before their fault (false verdicts), and why."""
        return {f"trial {i} ({t.scenario})": t.reason for i, t in enumerate(self.trials) if t.spoiled}


def run_trial(
    scenario: str,
    name: str,
    survivor_proc: common.Member,
    spawn: common.Member,
    quiet_s: float,
    victims: list[int],
) -> Trial:
    rank, busy, sig = SETUP[scenario]
    (port,) = common.free_ports(1)
    survivor_proc.tell({"cmd": "trial", "world": name, "rank": rank, "port": port, "busy": busy})
    spawn.tell({"world": name, "rank": 1 - rank, "port": port, "busy": busy})
    victim = spawn.wait_for("victim_joined", world=name)["pid"]
    victims.append(victim)
    survivor_proc.wait_for("joined", world=name)
    if busy:
        first_of(survivor_proc, name, "streaming", "broken")
    time.sleep(quiet_s)
    early = [e for e in survivor_proc.named("broken") if e["world"] == name]
    if early:  # broken before its fault: a false verdict, and no trial
        os.kill(victim, signal.SIGKILL)
        return Trial(scenario, early[0]["at"], early[0]["at"], early[0]["reason"], spoiled=True)
    signalled = time.time()
    os.kill(victim, sig)
    broken = survivor_proc.wait_for("broken", timeout=DETECT_WAIT_S, world=name)
    if sig != signal.SIGKILL:
        os.kill(victim, signal.SIGKILL)  # a frozen victim: gone before the next trial
    return Trial(scenario, signalled, broken["at"], broken["reason"])


def first_of(member: common.Member, world: str, *events: str) -> str:
    """Wait for the first of these events about `world`; its name."""
    deadline = time.monotonic() + common.MEMBER_WAIT_S
    while time.monotonic() < deadline:
        for event in events:
            if any(e["world"] == world for e in member.named(event)):
                return event
        time.sleep(0.05)
    raise MemberFailed(f"none of {events} about world {world} from {member.name}:\n{member.stderr()}")


def soak_worlds(phase: str) -> list[list[dict[str, Any]]]:
    """What each soak process joins: one world each way between every two of them (host
    first), alternately busy and idle, and one busy world of all."""
    plans: list[list[dict[str, Any]]] = [[] for _ in range(SOAKERS)]
    pairs = list(itertools.permutations(range(SOAKERS), 2))
    ports = common.free_ports(len(pairs) + 1)
    for i, ((host, member), port) in enumerate(zip(pairs, ports, strict=False)):
        for rank, soaker_index in enumerate((host, member)):
            plans[soaker_index].append(
                {"name": f"{phase}-s{host}{member}", "rank": rank, "size": 2, "port": port, "busy": i % 2 == 0}
            )
    for rank in range(SOAKERS):
        plans[rank].append({"name": f"{phase}-all", "rank": rank, "size": SOAKERS, "port": ports[-1], "busy": True})
    return plans


def run_soak(args: Any, members: common.Members, phase: str) -> Soak:
    plans = soak_worlds(phase)
    soakers = [members.start(f"{phase}-soak{i}", ["--member", "soaker"]) for i in range(SOAKERS)]
    for soak_proc, plan in zip(soakers, plans, strict=True):
        soak_proc.tell({"worlds": plan, "gil_hog": args.gil_hog})
    for soak_proc in soakers:
        soak_proc.wait_for("joined")
    started, started_at = time.monotonic(), time.time()
    time.sleep(args.soak_s)
    for soak_proc in soakers:
        soak_proc.tell({"cmd": "stop"})
    said = [soak_proc.wait_for("soaked") for soak_proc in soakers]
    seconds = time.monotonic() - started
    # A world that broke is one false verdict, when and where a member first saw it (the
    # others then see the verdict, or their ops fail).
    first: dict[str, tuple[float, str]] = {}
    for i, s in enumerate(said):
        for world, v in s["verdicts"].items():
            if world not in first or v["at"] < first[world][0]:
                first[world] = (v["at"], f"soak{i}: {v['reason']}")
    for soak_proc in soakers:
        soak_proc.tell({"cmd": "exit"})
    for soak_proc in soakers:
        soak_proc.wait_exit()
    return Soak(
        seconds=seconds,
        worlds=len({w["name"] for plan in plans for w in plan}),
        verdicts={world: why for world, (at, why) in first.items() if at >= started_at},
        joining={world: why for world, (at, why) in first.items() if at < started_at},
        longest_silence=max(s["longest_silence"] for s in said),
        late_readings=sum(s["late_readings"] for s in said),
        called_off=sum(s["called_off"] for s in said),
        steps=sum(s["steps"] for s in said),
    )


def run_phase(
    args: Any, name: str, load: int, members: common.Members, surv: common.Member, spawn: common.Member
) -> Phase:
    trials: list[Trial] = []
    victims: list[int] = []
    started = time.time()
    busy = BusyProcesses(load)
    try:
        try:
            for _ in range(args.trials):
                for scenario in SCENARIOS:
                    world = f"{name}-t{len(trials)}"
                    trials.append(run_trial(scenario, world, surv, spawn, args.quiet_s, victims))
                    time.sleep(args.after_s)
        finally:
            kill_all(victims)
        soak = run_soak(args, members, name)
        cores = busy.cores()
        machine = common.machine_load()
    finally:
        busy.stop()
    return Phase(name, load, started, time.time(), trials, soak, cores, machine)


def kill_all(pids: list[int]) -> None:
    """SIGKILL the victims (frozen ones included); they are the spawner's children, which
    outlive it otherwise."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def coordinate(args: Any) -> int:
    load = common.machine_load()
    script = common.program(__file__)
    (other_port,) = common.free_ports(1)
    phases: list[Phase] = []
    with common.Members(script) as members:
        surv = members.start("survivor", ["--member", "survivor", "--port", str(other_port)])
        peer_proc = members.start("peer", ["--member", "peer", "--port", str(other_port)])
        spawn = members.start("spawner", ["--member", "spawner"])
        surv.wait_for("ready")
        spawn.wait_for("ready")
        for name, count in [("baseline", 0)] + ([("loaded", args.load)] if args.load else []):
            phases.append(run_phase(args, name, count, members, surv, spawn))
        surv.tell({"cmd": "stop"})
        other = surv.wait_for("other")
        peer_proc.tell({"cmd": "stop"})
        peer_errors = peer_proc.wait_for("stopped")["errors"]
        surv.tell({"cmd": "exit"})
    present(args, load, phases, other["times"], other["errors"] + peer_errors)
    return 0


@dataclass(frozen=True)
class OtherWorld:
    median_step: float
    worst_failure: float
    worst_quiet: float
    worst_anywhere: float
    steps: int


def other_world(args: Any, phase: Phase, all_times: list[float]) -> OtherWorld:
    times = [t for t in all_times if phase.started <= t <= phase.ended]
    steps = common.gaps(times)
    median_step = statistics.median(steps)
    failure = [(t.signalled, t.detected + args.after_s) for t in phase.trials]
    quiet = [(t.signalled - args.quiet_s, t.signalled) for t in phase.trials]
    return OtherWorld(
        median_step=median_step,
        worst_failure=common.worst_gap_in(times, failure)[0] / median_step,
        worst_quiet=common.worst_gap_in(times, quiet)[0] / median_step,
        worst_anywhere=max(steps) / median_step,
        steps=len(times),
    )


def detect(phase: Phase) -> dict[str, common.Spread]:
    """Latencies per scenario (NaN where every trial was spoiled by a false verdict)."""
    nan = common.Spread(math.nan, math.nan, math.nan)
    return {
        s: common.Spread.of(lat)
        if (lat := [t.latency for t in phase.trials if t.scenario == s and not t.spoiled])
        else nan
        for s in SCENARIOS
    }


def present(args: Any, load: str, phases: list[Phase], times: list[float], errors: int) -> None:
    config = DetectConfig.from_env()
    others = {p.name: other_world(args, p, times) for p in phases}
    detected = {p.name: detect(p) for p in phases}
    rows = []
    for p in phases:
        for s in SCENARIOS:
            mine = [t for t in p.trials if t.scenario == s]
            spoiled = sum(t.spoiled for t in mine)
            d = detected[p.name][s]
            rows.append(
                [
                    p.name,
                    s,
                    f"{len(mine) - spoiled}" + (f" (+{spoiled} spoiled)" if spoiled else ""),
                    common.fmt_s(d.min),
                    common.fmt_s(d.median),
                    common.fmt_s(d.max),
                    SOURCE_LOCATION.sub("", mine[0].reason)[:60],
                ]
            )
    detect_table = common.table(["phase", "failure", "trials", "min", "median", "max", "first reason seen"], rows)
    soak_table = common.table(
        [
            "phase",
            "load",
            "load took",
            "soak",
            "worlds",
            "false verdicts",
            "while joining",
            "in trials",
            "longest silence",
            "late readings",
            "called off",
            "machine at the end",
        ],
        [
            [
                p.name,
                str(p.load),
                f"{p.load_cores:.2f} cores",
                common.fmt_s(p.soak.seconds),
                str(p.soak.worlds),
                str(len(p.soak.verdicts)),
                str(len(p.soak.joining)),
                str(len(p.spoiled)),
                common.fmt_s(p.soak.longest_silence),
                str(p.soak.late_readings),
                str(p.soak.called_off),
                p.machine.split(" (")[0],
            ]
            for p in phases
        ],
    )
    other_table = common.table(
        ["world 'other'"] + [p.name for p in phases],
        [
            ["steps"] + [str(others[p.name].steps) for p in phases],
            ["median step"] + [common.fmt_s(others[p.name].median_step) for p in phases],
            ["worst gap in failure windows / median"] + [f"{others[p.name].worst_failure:.2f}" for p in phases],
            ["worst gap in quiet windows / median"] + [f"{others[p.name].worst_quiet:.2f}" for p in phases],
            ["worst gap anywhere / median"] + [f"{others[p.name].worst_anywhere:.2f}" for p in phases],
        ],
    )
    verdicts = [
        f"  {p.name}{when}: {where}: {SOURCE_LOCATION.sub('', reason)}"
        for p in phases
        for when, said in (("", p.soak.verdicts), (" (joining)", p.soak.joining), (" (trial)", p.spoiled))
        for where, reason in said.items()
    ]
    body = [
        f"settings: heartbeat_interval {config.heartbeat_interval:g} s, dead_after {config.dead_after:g} s"
        + (", soak processes with a GIL hog each" if args.gil_hog else ""),
        detect_table,
        soak_table + ("\n\nfalse verdicts:\n" + "\n".join(verdicts) if verdicts else ""),
        other_table + f"\n\nerrors of world 'other' over all phases: {errors}",
    ]
    baseline = detected["baseline"]
    targets = [
        common.Target(f"baseline {s} median detection", baseline[s].median, limit, " s") for s, limit in TARGETS.items()
    ]
    targets += [
        common.Target(f"{p.name} false verdicts in {p.soak.seconds:.0f} s", len(p.soak.verdicts), 0) for p in phases
    ]
    targets += [
        common.Target("other world worst gap / median step (baseline)", others["baseline"].worst_failure, GAP_LIMIT),
        common.Target("other world errors", errors, 0),
    ]
    common.report("failover: detection latency, false verdicts under load, and the other world", load, body, targets)
    if args.json:
        common.json_line(
            {
                "failover": {
                    "settings": {"heartbeat_interval": config.heartbeat_interval, "dead_after": config.dead_after},
                    "other_world_errors": errors,
                    "phases": {
                        p.name: {
                            "load": p.load,
                            "load_cores": p.load_cores,
                            "detect_s": {s: detected[p.name][s].as_dict() for s in SCENARIOS},
                            "soak": p.soak.as_dict(),
                            "false_verdicts_in_trials": len(p.spoiled),
                            "other_world": {"worst_gap_ratio": others[p.name].worst_failure},
                        }
                        for p in phases
                    },
                }
            }
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.member == "survivor":
        survivor(args.port)
    elif args.member == "peer":
        peer(args.port)
    elif args.member == "spawner":
        spawner()
    elif args.member == "soaker":
        soaker()
    else:
        return coordinate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
