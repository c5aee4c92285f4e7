"""`multiworld run FILE.yaml`: the local platform's loop.

Each pod of the manifest becomes a local process; the planner decides everything, exactly as
in Kubernetes. This module only observes (process exits, worker reports and status over the
local channel: pod_processes.py) and executes (start, kill: pod_processes.py and launcher.py;
publish the world table: ../channel_server.py), injects the faults asked for (faults.py) and
follows the manifest's edits (manifest_follower.py). commands/run.py turns the command line
into a LocalRunner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from multiworld.contract import Backend
from multiworld_operator.channel_server import ChannelServer, local_url
from multiworld_operator.local.faults import FaultSchedule, Kill, SuspendWindow, kill_target
from multiworld_operator.local.gpus import cuda_device_count, gpu_env
from multiworld_operator.local.launcher import MemberLauncher, check_commands, member_commands
from multiworld_operator.local.manifest_follower import ManifestFollower
from multiworld_operator.local.pod_processes import PodProcesses
from multiworld_operator.local.processes import find_workdir
from multiworld_operator.local.store_ports import free_store_ports
from multiworld_operator.local.summary import RunSummary, WorldTrackers
from multiworld_operator.local.tether import Tether
from multiworld_operator.local.view import LiveView, world_rows
from multiworld_operator.planner import (
    Action,
    AssignSpare,
    CreatePod,
    DeletePod,
    EmitEvent,
    MultiWorldStatus,
    PublishTable,
    plan,
)
from multiworld_operator.spec import MultiWorld
from multiworld_operator.world_secrets import WorldSecrets, new_key

log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0
IDLE_TICK_S = 0.5


class LocalRunner:
    def __init__(
        self,
        multiworld: MultiWorld,
        *,
        manifest_dir: Path,
        kills: list[Kill],
        suspend: SuspendWindow | None = None,
        reload: Callable[[], MultiWorld] | None = None,
        watch: Path | None = None,
        chaos_per_minute: float = 0.0,
        duration: float | None = None,
        until_recovered: bool = False,
        seed: int | None = None,
        log_dir: Path | None = None,
        workdir: Path | None = None,
        view: LiveView | None = None,
    ) -> None:
        self.mw = multiworld
        self.suspend = suspend
        # The manifest file and how to read it again: an edit applies to the running MultiWorld.
        self.follower = ManifestFollower(reload, watch)
        self.duration = duration
        # End once every fault asked for happened and every world runs again: a fault injected
        # (a kill, a suspension) must first be seen to take the MultiWorld out of Running.
        self.until_recovered = until_recovered
        self.awaiting_recovery = False
        self.seen_down = False
        self.rng = random.Random(seed)
        self.faults = FaultSchedule(kills, chaos_per_minute, [m.name for m in multiworld.spec.members], self.rng)
        commands = member_commands(multiworld)
        self.workdir = workdir or find_workdir(
            next(iter(commands.values()))[0], [Path.cwd(), manifest_dir, *manifest_dir.parents]
        )
        check_commands(multiworld, commands, self.workdir)
        # Only once the input is known good: a refused run leaves nothing behind.
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"multiworld-{multiworld.name}-"))
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=self.log_dir).close()
        except OSError as error:
            raise ValueError(f"--log-dir {self.log_dir}: cannot write there ({error.strerror})") from None
        self.view = view or LiveView(f"multiworld run {multiworld.name}")
        self.status: MultiWorldStatus | None = None
        self.trackers = WorldTrackers(w.name for w in multiworld.spec.worlds)
        self.changed = asyncio.Event()
        self.up_since: float | None = None
        self.backends: dict[str, Backend] = {}
        self.gpus = cuda_device_count()
        for world in multiworld.spec.worlds:
            backend, warning = multiworld.local_backend_of(world.name, self.gpus > 0)
            self.backends[world.name] = backend
            if warning:
                self.view.event(f"warning: {warning}")
        # Processes in an NCCL world, in pod order: each gets its GPU from its place there.
        gpu_pods = [
            p for p in multiworld.all_pods() if any(self.backends[w] == "nccl" for w in multiworld.worlds_of_pod(p))
        ]
        gpu_envs = {p: gpu_env(p, i, len(gpu_pods), self.gpus) for i, p in enumerate(gpu_pods)}
        self.launcher = MemberLauncher(multiworld.name, commands, self.workdir, self.log_dir, gpu_envs)
        self.pods = PodProcesses(self.launcher, self.view, self.changed.set)
        worlds = [w.name for w in multiworld.spec.worlds]
        self.ports = dict(zip(worlds, free_store_ports(len(worlds)), strict=True))
        self.server = ChannelServer(
            on_report=lambda _, report: self.pods.on_report(report),
            on_status=lambda _, status: self.pods.on_status(status),
        )
        # Each world's secret at each epoch, handed to its members only (world_secrets.py): a
        # key of this run's own (the name may be edited in the manifest: fixed here).
        self.secrets = WorldSecrets(new_key(), multiworld.name)

    # --- outputs ------------------------------------------------------------------------
    async def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, DeletePod):
                await self.pods.delete(action.pod)
            elif isinstance(action, PublishTable):
                self.server.publish(self.secrets.table(action.table))
            elif isinstance(action, CreatePod):
                await self.pods.create(self.secrets.create(action))
            elif isinstance(action, AssignSpare):
                self.pods.assign(action.pod, action.member, action.ordinal)
            elif isinstance(action, EmitEvent):
                self.view.event(f"{action.type} {action.reason}: {action.message}")

    # --- faults -------------------------------------------------------------------------
    def _inject(self, kill: Kill) -> None:
        """SIGKILL the process that plays a pod of the member (a warm spare, where one plays it)."""
        target = kill_target(kill, self.mw, self.status, self.pods.running, self.rng)
        if target is None:
            self.view.event(f"kill {kill.member}{'' if kill.ordinal is None else f':{kill.ordinal}'}: no running pod")
            return
        pod, process = target
        by = f" (playing {pod})" if process != pod else ""
        self.view.event(f"injecting failure: SIGKILL {process}{by}")
        self.trackers.fault_injected(self.mw.worlds_of_pod(pod), time.monotonic())
        self.pods.kill(process)
        self.awaiting_recovery, self.seen_down = True, False

    # --- the loop -----------------------------------------------------------------------
    def _finished(self, fault_clock: float) -> bool:
        if self.status is None:
            return False
        if self.until_recovered and self._recovered(fault_clock):
            self.view.event("every fault is recovered from: ending the run (--until-recovered)")
            return True
        if all(ws.phase in ("Failed", "Succeeded") for ws in self.status.worlds.values()):
            return True
        return self.pods.all_succeeded()

    def _recovered(self, fault_clock: float) -> bool:
        """Every fault asked for happened, was seen, and every world runs again."""
        assert self.status is not None
        if self.awaiting_recovery and self.status.phase != "Running":
            self.seen_down = True
        if fault_clock < 0 or self.faults.next_at() is not None:
            return False
        if self.suspend is not None and self.suspend.next_change(fault_clock) is not None:
            return False
        return self.seen_down and self.status.phase == "Running"

    async def run(self) -> RunSummary:
        self.launcher.table_url = local_url(await self.server.start())
        self.launcher.tether = Tether()
        self.view.event(f"member logs in {self.log_dir}")
        started = time.monotonic()
        endpoint = lambda world, _rank0_pod: ("127.0.0.1", self.ports[world])  # noqa: E731
        try:
            while True:
                elapsed = time.monotonic() - started
                if self.duration is not None and elapsed >= self.duration:
                    break
                # Faults are timed from when every world first ran: a kill during start-up
                # would only test the rendezvous.
                if self.up_since is None and self.status is not None and self.status.phase == "Running":
                    self.up_since = time.monotonic()
                fault_clock = time.monotonic() - self.up_since if self.up_since is not None else -1.0
                for kill in self.faults.due(fault_clock):
                    self._inject(kill)
                self._follow_manifest()
                self._follow_suspend(fault_clock)
                self.changed.clear()
                result = plan(
                    self.mw, self.status, self.pods.observe(), endpoint=endpoint, backend_of=self.backends.__getitem__
                )
                await self._execute(result.actions)
                self.status = result.status
                self.trackers.observe(self.status, time.monotonic())
                self.view.update(world_rows(self.mw, self.status, self._errors_of), note=self.status.phase)
                if self._finished(fault_clock):
                    break
                next_fault = self.faults.next_at()
                next_switch = None if self.suspend is None else self.suspend.next_change(fault_clock)
                timeout = min(
                    IDLE_TICK_S,
                    result.requeue_after or IDLE_TICK_S,
                    IDLE_TICK_S if next_fault is None or fault_clock < 0 else next_fault - fault_clock,
                    IDLE_TICK_S if next_switch is None or fault_clock < 0 else next_switch - fault_clock,
                )
                if self.duration is not None:
                    timeout = min(timeout, self.duration - elapsed)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), max(timeout, 0.0))
        finally:
            orphans = await self.stop()
        return self.summary(orphans)

    def _follow_manifest(self) -> None:
        """Apply an edit of the manifest file (see manifest_follower.py)."""
        edit = self.follower.edited(self.mw, self.workdir, self.view)
        if edit is not None:
            self.mw, self.launcher.commands = edit

    def _follow_suspend(self, fault_clock: float) -> None:
        """Set spec.suspend as `--suspend` wants it now (timed like the faults)."""
        if self.suspend is None or fault_clock < 0:
            return
        wanted = self.suspend.wanted(fault_clock)
        if wanted != self.mw.spec.suspend:
            self.view.event("suspending: spec.suspend true" if wanted else "resuming: spec.suspend false")
            self.awaiting_recovery, self.seen_down = True, False
            self.mw = self.mw.model_copy(update={"spec": self.mw.spec.model_copy(update={"suspend": wanted})})

    def request_stop(self) -> None:
        self.view.event("stopping")
        self.duration = 0.0
        self.changed.set()

    async def stop(self) -> int:
        """Stop every member (TERM, then KILL) and count process groups that outlived that."""
        procs = await self.pods.stop(STOP_GRACE_S)
        await self.server.close()
        if self.launcher.tether is not None:
            self.launcher.tether.close()
        return sum(p.group_alive() for p in procs)

    def _errors_of(self, world: str) -> int:
        return self.trackers.errors_of(world, self.pods.breaks_of(world))

    def summary(self, orphans: int) -> RunSummary:
        return self.trackers.summary(self.mw, self.status, self.pods.breaks_of, orphans)
