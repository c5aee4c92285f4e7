"""`multiworld run FILE.yaml`: the local platform.

Each pod of the manifest becomes a local process; the planner decides everything, exactly as
in Kubernetes. This module only observes (process exits, worker reports and status over the
local channel) and executes (start, kill, publish the world table).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import random
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from multiworld.contract import Backend, BrokenWorldReport, WorkerStatus

from ..kube.ports import PORT_BASE, PORT_SPAN
from ..planner import (
    AssignSpare,
    CreatePod,
    DeletePod,
    EmitEvent,
    MultiWorldStatus,
    Observation,
    PodObservation,
    PublishTable,
    plan,
)
from ..spec import MultiWorld, SpecError, load_manifest, parse_manifest
from .channel_server import ChannelServer
from .faults import FaultSchedule, Kill, SuspendWindow, parse_suspend, planned_kills
from .gpus import cuda_device_count, gpu_env
from .processes import (
    RUN_ENV,
    MemberProcess,
    TemplateError,
    check_executable,
    container_command,
    find_workdir,
)
from .summary import RunSummary, WorldTracker
from .view import LiveView, WorldRow

log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0
IDLE_TICK_S = 0.5


def free_store_ports(count: int) -> list[int]:
    """`count` ports nothing on this machine holds now, one per world's store, drawn at random
    (runs side by side rarely draw the same) from the operator's range, below the kernel's
    ephemeral ports: there only a deliberate bind takes a port. An ephemeral one (what binding
    port 0 picks) can go to any socket of the machine (a listener on port 0, an outgoing
    connection) whenever rank 0 does not serve it, before its first join or after one that
    failed, and rank 0 then fails at every epoch for as long as that socket lives."""
    unheld = (port for port in random.sample(range(PORT_BASE, PORT_BASE + PORT_SPAN), PORT_SPAN) if _unheld(port))
    ports = list(itertools.islice(unheld, count))
    if len(ports) < count:
        raise RuntimeError(f"fewer than {count} free ports in {PORT_BASE}-{PORT_BASE + PORT_SPAN - 1}")
    return ports


def _unheld(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))  # every interface, as rank 0's store listens
        except OSError:
            return False
    return True


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
        seed: int | None = None,
        log_dir: Path | None = None,
        workdir: Path | None = None,
        view: LiveView | None = None,
    ) -> None:
        self.mw = multiworld
        self.suspend = suspend
        # The manifest file and how to read it again: an edit applies to the running MultiWorld.
        self.reload, self.watch = reload, watch
        self.watched = _mtime(watch)
        self.duration = duration
        self.rng = random.Random(seed)
        self.faults = FaultSchedule(kills, chaos_per_minute, [m.name for m in multiworld.spec.members], self.rng)
        self.commands = {
            m.name: container_command(multiworld.template_of(m.name), _template_field(multiworld, m.name))
            for m in multiworld.spec.members
        }
        self.workdir = workdir or find_workdir(
            next(iter(self.commands.values()))[0], [Path.cwd(), manifest_dir, *manifest_dir.parents]
        )
        for member, (argv, _) in self.commands.items():
            check_executable(argv, self.workdir, _template_field(multiworld, member))
        # Only once the input is known good: a refused run leaves nothing behind.
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"multiworld-{multiworld.name}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.view = view or LiveView(f"multiworld run {multiworld.name}")
        self.run_env = {RUN_ENV: multiworld.name}
        self.procs: dict[str, MemberProcess] = {}
        self.created_for: dict[str, dict[str, int]] = {}
        # Per process: its member and ordinal (None: a warm spare, until it plays a member pod).
        self.members: dict[str, tuple[str, int | None]] = {}
        self.joined: dict[str, dict[str, int]] = {}
        self.joining: dict[str, dict[str, int]] = {}
        self.warm: set[str] = set()  # spares whose worker waits for an identity
        self.reports: list[BrokenWorldReport] = []
        self.errors: dict[str, dict[str, int]] = {}  # errors per world, of finished incarnations
        self.live_errors: dict[str, dict[str, int]] = {}  # per pod, of its current incarnation
        self.status: MultiWorldStatus | None = None
        self.trackers = {w.name: WorldTracker() for w in multiworld.spec.worlds}
        self.changed = asyncio.Event()
        self.stopping = False
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
        self.gpu_envs = {p: gpu_env(p, i, len(gpu_pods), self.gpus) for i, p in enumerate(gpu_pods)}
        worlds = [w.name for w in multiworld.spec.worlds]
        self.ports = dict(zip(worlds, free_store_ports(len(worlds)), strict=True))
        self.server = ChannelServer(on_report=self._on_report, on_status=self._on_status)
        self.table_url = ""

    # --- inputs -------------------------------------------------------------------------
    def _on_report(self, report: BrokenWorldReport) -> None:
        self.reports.append(report)
        self.changed.set()

    def _on_status(self, status: WorkerStatus) -> None:
        if status.pod not in self.procs:
            return
        self.joined[status.pod] = dict(status.joined)
        self.joining[status.pod] = dict(status.joining)
        self.live_errors[status.pod] = dict(status.errors)
        if status.waiting:
            self.warm.add(status.pod)
        else:
            self.warm.discard(status.pod)
        self.changed.set()

    def _observe(self) -> Observation:
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
                    joining=self.joining.get(name, {}),
                    warm=name in self.warm,
                )
            )
        reports, self.reports = self.reports, []
        return Observation(now=datetime.now(UTC), pods=pods, reports=reports)

    # --- outputs ------------------------------------------------------------------------
    async def _execute(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, DeletePod):
                await self._delete(action.pod)
            elif isinstance(action, PublishTable):
                self.server.publish(action.table)
            elif isinstance(action, CreatePod):
                await self._create(action)
            elif isinstance(action, AssignSpare):
                self.members[action.pod] = (action.member, action.ordinal)
            elif isinstance(action, EmitEvent):
                self.view.event(f"{action.type} {action.reason}: {action.message}")

    async def _delete(self, pod: str) -> None:
        proc = self.procs.pop(pod, None)
        if proc is None:
            return
        await proc.stop(grace=0)
        self._retire(pod)

    def _retire(self, pod: str) -> None:
        """Fold a finished incarnation's error counts into the run's totals."""
        for world, count in self.live_errors.pop(pod, {}).items():
            self.errors.setdefault(world, {})
            self.errors[world][pod] = self.errors[world].get(pod, 0) + count
        self.joined.pop(pod, None)
        self.joining.pop(pod, None)
        self.warm.discard(pod)
        self.members.pop(pod, None)  # a spare's name never comes back

    async def _create(self, action: CreatePod) -> None:
        if action.pod in self.procs:
            return
        argv, env = self.commands[action.member]
        contract = action.worker_env(self.table_url).to_env()
        env = {**self.gpu_envs.get(action.pod, {}), **env, **self.run_env, **contract}
        proc = await MemberProcess.start(action.pod, argv, env, self.workdir, self.log_dir)
        self.procs[action.pod] = proc
        self.created_for[action.pod] = dict(action.created_for)
        self.members[action.pod] = (action.member, action.ordinal)
        self.joined[action.pod] = {}
        self.joining[action.pod] = {}
        asyncio.get_running_loop().create_task(self._watch_exit(proc))

    async def _watch_exit(self, proc: MemberProcess) -> None:
        code = await proc.proc.wait()
        if not self.stopping and not proc.killed_by_runner:
            self.view.event(f"{proc.pod} exited with code {code}")
        self.changed.set()

    # --- faults -------------------------------------------------------------------------
    def _inject(self, kill: Kill) -> None:
        """SIGKILL the process that plays a pod of the member (a warm spare, where one plays it)."""
        pods = self.mw.pods_of(kill.member)
        if kill.ordinal is not None:
            pods = [pods[kill.ordinal]]
        playing = {pod: self.status.played_by_pod(pod) if self.status else pod for pod in pods}
        pods = [p for p in pods if playing[p] in self.procs and self.procs[playing[p]].returncode is None]
        if not pods:
            self.view.event(f"kill {kill.member}{'' if kill.ordinal is None else f':{kill.ordinal}'}: no running pod")
            return
        pod = self.rng.choice(pods)
        by = f" (playing {pod})" if playing[pod] != pod else ""
        self.view.event(f"injecting failure: SIGKILL {playing[pod]}{by}")
        for world in self.mw.worlds_of_pod(pod):
            self.trackers[world].fault_injected(time.monotonic())
        self.procs[playing[pod]].kill()

    # --- the loop -----------------------------------------------------------------------
    def _rows(self) -> list[WorldRow]:
        rows = []
        for world in self.mw.spec.worlds:
            ws = self.status.worlds.get(world.name) if self.status else None
            rows.append(
                WorldRow(
                    name=world.name,
                    phase=ws.phase if ws else "Pending",
                    epoch=ws.epoch if ws else 1,
                    ready=ws.ready_ranks if ws else 0,
                    size=len(self.mw.world_pods(world.name)),
                    restarts=ws.restarts if ws else 0,
                    errors=self._errors_of(world.name),
                )
            )
        return rows

    def _errors_of(self, world: str) -> int:
        finished = sum(self.errors.get(world, {}).values())
        return finished + sum(errs.get(world, 0) for errs in self.live_errors.values())

    def _finished(self) -> bool:
        if self.status is None:
            return False
        if all(ws.phase in ("Failed", "Succeeded") for ws in self.status.worlds.values()):
            return True
        return (
            bool(self.procs)
            and all(p.returncode is not None for p in self.procs.values())
            and all(self.procs[p].returncode == 0 for p in self.procs)
        )

    async def run(self) -> RunSummary:
        self.table_url = await self.server.start()
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
                    self.mw, self.status, self._observe(), endpoint=endpoint, backend_of=self.backends.__getitem__
                )
                await self._execute(result.actions)
                self.status = result.status
                now = time.monotonic()
                for name, ws in self.status.worlds.items():
                    self.trackers[name].observe(ws.phase, ws.epoch, ws.restarts, ws.ready_ranks >= ws.size, now)
                self.view.update(self._rows(), note=self.status.phase)
                if self._finished():
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
        """Apply an edit of the manifest file (the local `kubectl apply`): templates (rolled out
        per spec.updateStrategy), failure policies, spares, suspend. Members, replicas and worlds
        stay as the run began; an edit that changes them, or is invalid, is refused and said."""
        mtime = _mtime(self.watch)
        if self.reload is None or mtime == self.watched:
            return
        self.watched = mtime
        try:
            edited = self.reload()
            if _layout(edited) != _layout(self.mw):
                raise ValueError("its members, replicas and worlds differ: start the run again for that")
            commands = {
                m.name: container_command(edited.template_of(m.name), _template_field(edited, m.name))
                for m in edited.spec.members
            }
            for member, (argv, _) in commands.items():
                check_executable(argv, self.workdir, _template_field(edited, member))
        except (SpecError, ValueError, TemplateError, ValidationError, OSError) as exc:
            self.view.event(f"manifest edit refused: {exc}")
            return
        self.view.event("manifest edited: applying it")
        self.mw, self.commands = edited, commands

    def _follow_suspend(self, fault_clock: float) -> None:
        """Set spec.suspend as `--suspend` wants it now (timed like the faults)."""
        if self.suspend is None or fault_clock < 0:
            return
        wanted = self.suspend.wanted(fault_clock)
        if wanted != self.mw.spec.suspend:
            self.view.event("suspending: spec.suspend true" if wanted else "resuming: spec.suspend false")
            self.mw = self.mw.model_copy(update={"spec": self.mw.spec.model_copy(update={"suspend": wanted})})

    def request_stop(self) -> None:
        self.view.event("stopping")
        self.duration = 0.0
        self.changed.set()

    async def stop(self) -> int:
        """Stop every member (TERM, then KILL) and count process groups that outlived that."""
        self.stopping = True
        procs = list(self.procs.values())
        await asyncio.gather(*(p.stop(STOP_GRACE_S) for p in procs))
        for pod in list(self.procs):
            self._retire(pod)
        await self.server.close()
        return sum(p.group_alive() for p in procs)

    def summary(self, orphans: int) -> RunSummary:
        worlds = {}
        for world in self.mw.spec.worlds:
            ws = self.status.worlds.get(world.name) if self.status else None
            worlds[world.name] = self.trackers[world.name].summary(
                phase=ws.phase if ws else "Pending", epoch=ws.epoch if ws else 1, errors=self._errors_of(world.name)
            )
        return RunSummary(worlds=worlds, orphans=orphans)


def with_spares(multiworld: MultiWorld, choices: list[str]) -> MultiWorld:
    """The MultiWorld with `--spares` applied: `N` for every member, `MEMBER=N` for one (later
    choices win)."""
    data = multiworld.model_dump(by_alias=True, exclude_none=True)
    members = {m["name"]: m for m in data["spec"]["members"]}
    for choice in choices:
        member, _, count = choice.rpartition("=")
        if not count.isdigit():
            raise ValueError(f"--spares {choice}: expected N or MEMBER=N with N a whole number >= 0")
        if member and member not in members:
            raise ValueError(f"--spares {choice}: no member named {member!r} in the manifest")
        for name in [member] if member else list(members):
            members[name]["spares"] = int(count)
    try:
        return parse_manifest(data)
    except SpecError as error:
        raise ValueError("--spares: " + "; ".join(error.problems)) from None


def _mtime(path: Path | None) -> int | None:
    try:
        return None if path is None else path.stat().st_mtime_ns
    except OSError:
        return None


def _layout(multiworld: MultiWorld) -> tuple[object, ...]:
    """What a running local MultiWorld keeps: its name, members' replicas, worlds and backends."""
    spec = multiworld.spec
    return (
        multiworld.name,
        spec.backend,
        [(m.name, m.replicas) for m in spec.members],
        [(w.name, w.ranks, w.backend) for w in spec.worlds],
    )


def _load(args: argparse.Namespace) -> MultiWorld:
    """The manifest file, with `--spares` applied."""
    mw = load_manifest(args.file)
    return with_spares(mw, args.spares) if args.spares else mw


def _template_field(multiworld: MultiWorld, member: str) -> str:
    index = [m.name for m in multiworld.spec.members].index(member)
    if multiworld.spec.members[index].template is not None:
        return f"spec.members[{index}].template"
    return "spec.template"


def _fail(message: str) -> int:
    sys.stderr.write(f"multiworld run: {message}\n")
    return 2


def run_from_args(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        return _fail(f"FILE: {args.file} does not exist")
    try:
        mw = _load(args)
        kills = planned_kills(args.kill, args.after)
        suspend = parse_suspend(args.suspend) if args.suspend else None
        for kill in kills:
            pods = mw.pods_of(kill.member) if kill.member in {m.name for m in mw.spec.members} else None
            if pods is None:
                raise ValueError(f"--kill {kill.member}: no member named {kill.member!r} in the manifest")
            if kill.ordinal is not None and kill.ordinal >= len(pods):
                raise ValueError(f"--kill {kill.member}:{kill.ordinal}: member {kill.member!r} has {len(pods)} pod(s)")
        view = LiveView(f"multiworld run {mw.name}", live=False if args.no_view else None)
        runner = LocalRunner(
            mw,
            manifest_dir=args.file.resolve().parent,
            kills=kills,
            suspend=suspend,
            reload=lambda: _load(args),
            watch=args.file,
            chaos_per_minute=args.chaos,
            duration=args.duration,
            seed=args.seed,
            log_dir=args.log_dir,
            workdir=args.workdir,
            view=view,
        )
    except SpecError as exc:
        return _fail(f"{args.file} is not a valid MultiWorld:\n" + "\n".join(f"  {p}" for p in exc.problems))
    except (ValueError, TemplateError, ValidationError) as exc:
        return _fail(str(exc))
    summary = asyncio.run(_run_until_signal(runner))
    sys.stderr.write(summary.render())
    if args.json:
        sys.stdout.write(json.dumps(summary.model_dump(mode="json"), separators=(",", ":")) + "\n")
    return 1 if any(w.phase == "Failed" for w in summary.worlds.values()) else 0


async def _run_until_signal(runner: LocalRunner) -> RunSummary:
    """Ctrl-C or SIGTERM ends the run cleanly: members stopped, summary printed."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, runner.request_stop)
    return await runner.run()
