"""Failure detection latency, and what a failure costs another world of the same process.

A survivor process holds a long-lived world "other" (with a peer process) that steps an
all_reduce about every 20 ms, and, trial after trial, a fresh two-rank world with a victim
process, which is then:
  crash_busy  SIGKILLed during a stream of all_reduces (the survivor is rank 0)
  crash_idle  SIGKILLed with no op in flight (the survivor is rank 0)
  frozen      SIGSTOPped during a stream of all_reduces (the survivor is rank 0)
  store_host  SIGKILLed while it is rank 0, the world's store host, no op in flight
Latency runs from the signal to the WorldBrokenError raised in the survivor (an idle survivor
polls `world.broken` every millisecond, then its next op raises). Victims are forked from a
process that has already imported torch, so a trial does not wait for an import.

For "other": its worst step gap inside the failure windows (signal to detection + 1 s) over
its median step, and the errors it raised in either of its processes. The same ratio in
equally long quiet windows just before each signal shows the machine's own noise.
Detection settings come from the MULTIWORLD_* environment (defaults as shipped).
"""

from __future__ import annotations

import argparse
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

from tests.support import bench_common as common

SCENARIOS = ("crash_busy", "crash_idle", "frozen", "store_host")
# (survivor rank, busy, signal) per scenario; the victim holds the other rank of two.
SETUP = {
    "crash_busy": (0, True, signal.SIGKILL),
    "crash_idle": (0, False, signal.SIGKILL),
    "frozen": (0, True, signal.SIGSTOP),
    "store_host": (1, False, signal.SIGKILL),
}
STEP_SLEEP_S = 0.02
STREAMING_AFTER = 20  # ops of the busy stream before a trial counts as streaming
IDLE_POLL_S = 0.001
DETECT_WAIT_S = 60.0
TARGETS = {"crash_busy": 0.1, "frozen": 1.5}
GAP_LIMIT = 3.0
# gloo's source location in its error messages: noise in a table.
SOURCE_LOCATION = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ?")


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.setting("--trials", int, 5, 1, "trials per scenario")
    p.setting("--quiet-s", float, 1.0, 0.5, "seconds of steady state before each signal, also the quiet window")
    p.setting("--after-s", float, 1.0, 0.5, "seconds after each detection that still count as the failure window")
    p.add_argument("--member", choices=["survivor", "peer", "spawner"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- the member side -------------------------------------------------------------------------


def assignment(name: str, rank: int, port: int) -> Any:
    import multiworld as mw

    return mw.WorldAssignment(name=name, rank=rank, size=2, host="127.0.0.1", port=port)


def manager(pod: str) -> Any:
    import torch

    import multiworld as mw

    torch.set_num_threads(1)
    return mw.WorldManager(pod=pod, config=mw.DetectConfig.from_env())


class Stepper:
    """The other world's loop on its own thread: one small all_reduce, then a short sleep."""

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
                    common.emit("other_broken", reason=exc.reason)
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


# ---- the coordinator -------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    scenario: str
    signalled: float
    detected: float
    reason: str

    @property
    def latency(self) -> float:
        return self.detected - self.signalled


def run_trial(
    scenario: str,
    index: int,
    survivor_proc: common.Member,
    spawn: common.Member,
    quiet_s: float,
    victims: list[int],
) -> Trial:
    rank, busy, sig = SETUP[scenario]
    name = f"t{index}"
    (port,) = common.free_ports(1)
    survivor_proc.tell({"cmd": "trial", "world": name, "rank": rank, "port": port, "busy": busy})
    spawn.tell({"world": name, "rank": 1 - rank, "port": port, "busy": busy})
    victim = spawn.wait_for("victim_joined", world=name)["pid"]
    victims.append(victim)
    survivor_proc.wait_for("joined", world=name)
    if busy:
        survivor_proc.wait_for("streaming", world=name)
    time.sleep(quiet_s)
    signalled = time.time()
    os.kill(victim, sig)
    broken = survivor_proc.wait_for("broken", timeout=DETECT_WAIT_S, world=name)
    if sig != signal.SIGKILL:
        os.kill(victim, signal.SIGKILL)  # a frozen victim: gone before the next trial
    return Trial(scenario, signalled, broken["at"], broken["reason"])


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
    trials: list[Trial] = []
    victims: list[int] = []
    with common.Members(script) as members:
        surv = members.start("survivor", ["--member", "survivor", "--port", str(other_port)])
        peer_proc = members.start("peer", ["--member", "peer", "--port", str(other_port)])
        spawn = members.start("spawner", ["--member", "spawner"])
        surv.wait_for("ready")
        spawn.wait_for("ready")
        try:
            for _ in range(args.trials):
                for scenario in SCENARIOS:
                    trials.append(run_trial(scenario, len(trials), surv, spawn, args.quiet_s, victims))
                    time.sleep(args.after_s)
        finally:
            kill_all(victims)
        surv.tell({"cmd": "stop"})
        other = surv.wait_for("other")
        peer_proc.tell({"cmd": "stop"})
        peer_errors = peer_proc.wait_for("stopped")["errors"]
        surv.tell({"cmd": "exit"})
    present(args, load, trials, other["times"], other["errors"] + peer_errors)
    return 0


def present(args: Any, load: str, trials: list[Trial], times: list[float], errors: int) -> None:
    steps = common.gaps(times)
    median_step = statistics.median(steps)
    failure = [(t.signalled, t.detected + args.after_s) for t in trials]
    quiet = [(t.signalled - args.quiet_s, t.signalled) for t in trials]
    worst_failure = common.worst_gap_in(times, failure)[0] / median_step
    worst_quiet = common.worst_gap_in(times, quiet)[0] / median_step
    detect = {s: common.Spread.of(t.latency for t in trials if t.scenario == s) for s in SCENARIOS}

    rows = []
    for s in SCENARIOS:
        mine = [t for t in trials if t.scenario == s]
        reason = SOURCE_LOCATION.sub("", mine[0].reason)
        d = detect[s]
        gap, offset = common.worst_gap_in(times, [(t.signalled, t.detected + args.after_s) for t in mine])
        rows.append(
            [
                s,
                str(len(mine)),
                common.fmt_s(d.min),
                common.fmt_s(d.median),
                common.fmt_s(d.max),
                f"{gap / median_step:.2f} at {offset:+.2f} s",
                reason[:60],
            ]
        )
    detect_table = common.table(
        ["failure", "trials", "min", "median", "max", "other's worst gap/median", "first reason seen"], rows
    )
    other_table = common.table(
        ["world 'other'", "value"],
        [
            ["steps", str(len(times))],
            ["median step", common.fmt_s(median_step)],
            ["worst gap in failure windows / median", f"{worst_failure:.2f}"],
            ["worst gap in quiet windows / median", f"{worst_quiet:.2f}"],
            ["worst gap anywhere / median", f"{max(steps) / median_step:.2f}"],
            ["errors", str(errors)],
        ],
    )
    targets = [common.Target(f"{s} median detection", detect[s].median, limit, " s") for s, limit in TARGETS.items()]
    targets += [
        common.Target("other world worst gap / median step", worst_failure, GAP_LIMIT),
        common.Target("other world errors", errors, 0),
    ]
    common.report(
        "failover: detection latency, and the other world of the same process",
        load,
        [detect_table, other_table],
        targets,
    )
    if args.json:
        common.json_line(
            {
                "failover": {
                    "detect_s": {s: detect[s].as_dict() for s in SCENARIOS},
                    "other_world": {"worst_gap_ratio": worst_failure, "errors": errors},
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
    else:
        return coordinate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
