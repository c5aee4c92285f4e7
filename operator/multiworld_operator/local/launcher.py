"""How a local run starts the process of a pod: its member's command (from the pod template),
the worker contract's environment, the GPU it gets, its metrics port, the folder it runs in and
its log."""

from __future__ import annotations

from pathlib import Path

from multiworld.contract import ENV_METRICS_PORT, metrics_port_from_env
from multiworld_operator.local.processes import RUN_ENV, MemberProcess, check_executable, container_command
from multiworld_operator.local.tether import Tether
from multiworld_operator.planner import CreatePod
from multiworld_operator.spec import MultiWorld

# Member -> the argv and the plain env values of its template's first container.
Commands = dict[str, tuple[list[str], dict[str, str]]]


def member_commands(multiworld: MultiWorld) -> Commands:
    """Every member's command; TemplateError, naming the field, for a template that cannot run
    as a local process."""
    return {
        m.name: container_command(multiworld.template_of(m.name), _template_field(multiworld, m.name))
        for m in multiworld.spec.members
    }


def check_commands(multiworld: MultiWorld, commands: Commands, workdir: Path) -> None:
    """Refuse, naming the field, a command this machine cannot execute from `workdir`."""
    for member, (argv, _) in commands.items():
        check_executable(argv, workdir, _template_field(multiworld, member))


def _template_field(multiworld: MultiWorld, member: str) -> str:
    index = [m.name for m in multiworld.spec.members].index(member)
    if multiworld.spec.members[index].template is not None:
        return f"spec.members[{index}].template"
    return "spec.template"


class MemberLauncher:
    """Starts pods of one run. `commands` follows the manifest's edits; `table_url` is where
    the workers follow the live table (the runner's channel server, once it listens); `tether`
    holds every process started (set when the run starts)."""

    def __init__(
        self,
        multiworld: str,
        commands: Commands,
        workdir: Path,
        log_dir: Path,
        gpu_envs: dict[str, dict[str, str]],
    ) -> None:
        self.commands = commands
        self.workdir = workdir
        self.log_dir = log_dir
        self.gpu_envs = gpu_envs
        self.run_env = {RUN_ENV: multiworld}
        self.table_url = ""
        self.tether: Tether | None = None
        # Pod -> the port it serves its metrics on (kept across its restarts).
        self.metrics_ports: dict[str, int] = {}

    async def start(self, action: CreatePod) -> MemberProcess:
        argv, env = self.commands[action.member]
        contract = action.worker_env(self.table_url).to_env()
        env = {**self.gpu_envs.get(action.pod, {}), **env, **self.run_env, **contract}
        port = self._metrics_port(action.pod, env)
        if port is not None:
            env[ENV_METRICS_PORT] = str(port)
        assert self.tether is not None, "the run has not started"
        return await MemberProcess.start(action.pod, argv, env, self.workdir, self.log_dir, self.tether)

    def _metrics_port(self, pod: str, env: dict[str, str]) -> int | None:
        """Local processes share the machine's ports: a pod whose environment asks for metrics
        on port P serves them on its own port, the lowest from P up that no other pod of the
        run has. A bad value is passed on as it is: the worker stops at start naming it."""
        try:
            asked = metrics_port_from_env(env)
        except ValueError:
            return None
        if asked is None:
            return None
        if pod not in self.metrics_ports:
            taken = set(self.metrics_ports.values())
            self.metrics_ports[pod] = next((p for p in range(asked, 65536) if p not in taken), asked)
        return self.metrics_ports[pod]
