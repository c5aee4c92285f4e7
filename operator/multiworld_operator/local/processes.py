"""Member pods as local processes: start one from its pod template, watch it, stop it.

Each process leads its own session (process group), so stopping a member also stops anything
it spawned: `multiworld run` leaves no orphan behind. The run's tether (tether.py) holds every
group from its start until it is reaped, so that none outlives a runner that dies unannounced.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from multiworld_operator.local.tether import Tether

log = logging.getLogger(__name__)

# Each process's output in its pod's log follows a line that starts so.
START_MARK = b"--- start "
# What `output_tail` shows of a process that failed: its last lines, read from the log's end.
TAIL_LINES = 5
TAIL_BYTES = 4096


class TemplateError(ValueError):
    """A pod template that cannot run as a local process; the message names the field."""


def container_command(template: Mapping[str, Any], field: str) -> tuple[list[str], dict[str, str]]:
    """The first container's command + args and plain env values, as a local process runs them.

    A command that starts with `python` runs under this interpreter, so the manifest that names
    the worker image's python works unchanged on a laptop.
    """
    containers = (template.get("spec") or {}).get("containers") or []
    if not containers:
        raise TemplateError(f"{field}.spec.containers: at least one container is required")
    container = containers[0]
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    if not argv:
        raise TemplateError(f"{field}.spec.containers[0]: a command is required to run locally (the image is ignored)")
    if Path(argv[0]).name.startswith("python"):
        argv[0] = sys.executable
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        if "value" in item:
            env[str(item["name"])] = str(item["value"])
        else:
            log.warning("%s.spec.containers[0].env[%s]: valueFrom is ignored locally", field, item.get("name"))
    return argv, env


def check_executable(argv: list[str], workdir: Path, field: str) -> None:
    """Refuse, naming the field, a command this machine cannot execute from `workdir`: its
    program, or a script it names (an argument ending in .py), missing there."""
    program = argv[0]
    found = str(workdir / program) if "/" in program else shutil.which(program)
    if found is None or not Path(found).is_file() or not os.access(found, os.X_OK):
        where = f"no executable file at {found}" if "/" in program else "not found on PATH"
        raise TemplateError(f"{field}.spec.containers[0]: command {program!r} cannot be executed here ({where})")
    for script in _scripts(argv):
        if not (workdir / script).is_file():
            raise TemplateError(
                f"{field}.spec.containers[0]: script {script!r} is not in {workdir}, the members' working "
                "directory (--workdir, else the first of the current directory, the manifest's folder and "
                "its parents that holds the command's scripts)"
            )


def _scripts(argv: list[str]) -> list[str]:
    return [a for a in argv[1:] if a.endswith(".py")]


def find_workdir(argv: list[str], candidates: list[Path]) -> Path:
    """The first candidate directory in which the command's relative script paths exist (the
    first candidate when none has them: check_executable then says so)."""
    scripts = [s for s in _scripts(argv) if not os.path.isabs(s)]
    for directory in candidates:
        if all((directory / s).is_file() for s in scripts):
            return directory
    return candidates[0]


class MemberProcess:
    """One incarnation of one pod."""

    def __init__(self, pod: str, proc: asyncio.subprocess.Process, log_path: Path, tether: Tether) -> None:
        self.pod = pod
        self.proc = proc
        self.log_path = log_path
        self.tether = tether
        self.started = time.monotonic()
        self.killed_by_runner = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @classmethod
    async def start(
        cls,
        pod: str,
        argv: list[str],
        env: Mapping[str, str],
        workdir: Path,
        log_dir: Path,
        tether: Tether,
    ) -> MemberProcess:
        log_path = log_dir / f"{pod}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        with open(log_path, "ab") as out:
            out.write(START_MARK + f"{shlex.join(argv)}\n".encode())
            out.flush()
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=workdir,
                env=full_env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        tether.hold(proc.pid)
        log.debug("started %s pid=%d", pod, proc.pid)
        return cls(pod, proc, log_path, tether)

    def signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the whole process group (fault injection and final clean-up)."""
        self.killed_by_runner = True
        self.signal(signal.SIGKILL)

    async def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; always reaps the group."""
        self.killed_by_runner = True
        if self.proc.returncode is None:
            self.signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace)
            except TimeoutError:
                pass
        self.signal(signal.SIGKILL)
        await self.proc.wait()
        self.tether.release(self.proc.pid)

    def group_alive(self) -> bool:
        """Whether any process of this member's group still exists (an orphan, after stop)."""
        return group_alive(self.proc.pid)


def output_tail(log_path: Path) -> str:
    """The last lines the latest process wrote to `log_path` (none of an earlier one's)."""
    try:
        with open(log_path, "rb") as log_file:
            size = log_file.seek(0, os.SEEK_END)
            log_file.seek(max(0, size - TAIL_BYTES))
            end = log_file.read()
    except OSError:
        return ""
    start = end.rfind(START_MARK)
    if start >= 0:
        end = end[end.find(b"\n", start) + 1 :] if b"\n" in end[start:] else b""
    lines = end.decode(errors="replace").splitlines()
    return "\n".join(line.rstrip() for line in lines[-TAIL_LINES:])


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# In the environment every process of a run starts with: the MultiWorld it runs.
RUN_ENV = "MULTIWORLD_RUN"
