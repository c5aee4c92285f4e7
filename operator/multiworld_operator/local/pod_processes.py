"""The pods of a local run as processes, and what their workers said over the channel: the
planner's Observation of them, and the deletes, creates and spare assignments of its plans.

A process plays the member pod it was created as, or (a warm spare) none until the planner
assigns it one. The breaks its workers report are counted per world and epoch (the summary
tells planned changes from failures by the epoch). A process that exits with an error is said
once per distinct failure with the last lines of its output; a member whose processes keep
exiting before joining any world is said to be crash-looping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime

from multiworld.contract import JOIN_FAILED, BrokenWorldReport, WorkerStatus
from multiworld_operator.local.launcher import MemberLauncher
from multiworld_operator.local.processes import MemberProcess, output_tail
from multiworld_operator.local.view import LiveView
from multiworld_operator.planner import CreatePod, Observation, PodObservation

# Starts in a row of a member that exit with an error before joining any world: crash-looping.
CRASH_LOOP_STARTS = 3


class PodProcesses:
    """`on_change` is called whenever a process ended or a worker said something."""

    def __init__(self, launcher: MemberLauncher, view: LiveView, on_change: Callable[[], None]) -> None:
        self.launcher = launcher
        self.view = view
        self.on_change = on_change
        self.procs: dict[str, MemberProcess] = {}
        self.created_for: dict[str, dict[str, int]] = {}
        # Per process: its member and ordinal (None: a warm spare, until it plays a member pod).
        self.members: dict[str, tuple[str, int | None]] = {}
        self.joined: dict[str, dict[str, int]] = {}
        self.joined_at: dict[str, dict[str, datetime]] = {}
        self.joining: dict[str, dict[str, int]] = {}
        self.warm: set[str] = set()  # spares whose worker waits for an identity
        self.reports: list[BrokenWorldReport] = []
        self.breaks: dict[str, dict[int, int]] = {}  # per world and epoch: breaks reported
        # (pod, world, epoch) of each break counted: a worker sends its latest report again on
        # every connection, and a report replayed is the same break.
        self.counted: set[tuple[str, str, int]] = set()
        self.ever_joined: set[str] = set()  # processes that joined a world at least once
        self.failed_starts: dict[str, int] = {}  # per member: starts in a row that never joined
        self.failures_said: set[str] = set()  # the last output of every failed process said so far
        self.stopping = False

    # --- what the workers say (the channel server's callbacks) ----------------------------
    def on_report(self, report: BrokenWorldReport) -> None:
        self.reports.append(report)
        once = (report.pod, report.world, report.epoch)
        # A break heard while the run stops its processes is the run's own doing (a member
        # stopped before its peers): no error.
        if not self.stopping and not report.reason.startswith(JOIN_FAILED) and once not in self.counted:
            self.counted.add(once)
            epochs = self.breaks.setdefault(report.world, {})
            epochs[report.epoch] = epochs.get(report.epoch, 0) + 1
        self.on_change()

    def on_status(self, status: WorkerStatus) -> None:
        if status.pod not in self.procs:
            return
        self.joined[status.pod] = dict(status.joined)
        self.joined_at[status.pod] = dict(status.joined_at)
        self.joining[status.pod] = dict(status.joining)
        if status.joined:
            self.ever_joined.add(status.pod)
        if status.waiting:
            self.warm.add(status.pod)
        else:
            self.warm.discard(status.pod)
        self.on_change()

    # --- what the planner sees ------------------------------------------------------------
    def observe(self) -> Observation:
        """The processes as pods, and the reports since the last observation."""
        pods = []
        for name, proc in self.procs.items():
            member, ordinal = self.members[name]
            code = proc.returncode
            phase = "Running" if code is None else ("Succeeded" if code == 0 else "Failed")
            pods.append(
                PodObservation(
                    name=name,
                    member=member,
                    ordinal=ordinal or 0,
                    phase=phase,
                    created_for=self.created_for[name],
                    joined=self.joined.get(name, {}),
                    joined_at=self.joined_at.get(name, {}),
                    joining=self.joining.get(name, {}),
                    warm=name in self.warm,
                )
            )
        reports, self.reports = self.reports, []
        return Observation(now=datetime.now(UTC), pods=pods, reports=reports)

    def running(self, pod: str) -> bool:
        return pod in self.procs and self.procs[pod].returncode is None

    def all_succeeded(self) -> bool:
        """Whether there are processes and every one of them exited 0."""
        return (
            bool(self.procs)
            and all(p.returncode is not None for p in self.procs.values())
            and all(self.procs[p].returncode == 0 for p in self.procs)
        )

    def breaks_of(self, world: str) -> dict[int, int]:
        """Per epoch of `world`: the breaks its processes reported (each an error raised to
        member code in that world)."""
        return self.breaks.get(world, {})

    # --- what the planner's plans do ------------------------------------------------------
    async def delete(self, pod: str) -> None:
        proc = self.procs.pop(pod, None)
        if proc is None:
            return
        await proc.stop(grace=0)
        self._retire(pod)

    async def create(self, action: CreatePod) -> None:
        if action.pod in self.procs:
            return
        known = action.pod in self.launcher.metrics_ports
        proc = await self.launcher.start(action)
        port = self.launcher.metrics_ports.get(action.pod)
        if port is not None and not known:
            self.view.event(f"pod {action.pod} serves its metrics on port {port}")
        self.procs[action.pod] = proc
        self.created_for[action.pod] = dict(action.created_for)
        self.members[action.pod] = (action.member, action.ordinal)
        self.joined[action.pod] = {}
        self.joined_at[action.pod] = {}
        self.joining[action.pod] = {}
        self.ever_joined.discard(action.pod)
        asyncio.get_running_loop().create_task(self._watch_exit(proc))

    def assign(self, pod: str, member: str, ordinal: int) -> None:
        """A warm spare plays member pod `ordinal` of `member` from now on."""
        self.members[pod] = (member, ordinal)

    def kill(self, pod: str) -> None:
        """SIGKILL the process (fault injection)."""
        self.procs[pod].kill()

    async def stop(self, grace: float) -> list[MemberProcess]:
        """Stop every process (TERM, then KILL after `grace`); the processes stopped."""
        self.stopping = True
        procs = list(self.procs.values())
        await asyncio.gather(*(p.stop(grace) for p in procs))
        for pod in list(self.procs):
            self._retire(pod)
        return procs

    def _retire(self, pod: str) -> None:
        """Forget what a deleted process's worker said."""
        self.joined.pop(pod, None)
        self.joined_at.pop(pod, None)
        self.joining.pop(pod, None)
        self.warm.discard(pod)
        self.members.pop(pod, None)  # a spare's name never comes back

    async def _watch_exit(self, proc: MemberProcess) -> None:
        code = await proc.proc.wait()
        if not self.stopping and not proc.killed_by_runner:
            self._said_exit(proc, code)
        self.on_change()

    def _said_exit(self, proc: MemberProcess, code: int) -> None:
        """Say that `proc` exited on its own: with its last output the first time a process
        fails so, and once when its member is crash-looping."""
        member = self.members.get(proc.pod, ("", None))[0]
        if code == 0:
            self.view.event(f"{proc.pod} exited with code 0")
            return
        tail = output_tail(proc.log_path)
        if tail not in self.failures_said:  # a failure said once: the worlds' events go on
            self.failures_said.add(tail)
            shown = "\n".join(f"  | {line}" for line in tail.splitlines()) or "  | (no output)"
            self.view.event(
                f"{proc.pod} exited with code {code}; its output ends with:\n{shown}\n  (log: {proc.log_path})"
            )
        if proc.pod in self.ever_joined:
            self.failed_starts[member] = 0
            return
        self.failed_starts[member] = self.failed_starts.get(member, 0) + 1
        if self.failed_starts[member] == CRASH_LOOP_STARTS:
            self.view.event(
                f"member {member} is crash-looping: {CRASH_LOOP_STARTS} starts in a row exited with an "
                f"error before joining any world; its output is above, its log in {proc.log_path}"
            )
