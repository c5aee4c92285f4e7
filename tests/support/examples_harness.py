"""Runs the example programs as real processes and reads what they print."""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from multiworld.contract import WorkerEnv, WorldEntry, WorldTable
from multiworld_operator.local.gpus import gpu_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

# Generous bounds: the machine is small and shared; these only turn a hang into a failure.
START_TIMEOUT = 120.0
EXIT_TIMEOUT = 120.0

# The seed topology: the leader is rank 0 of world1 and world2, four workers fill ranks 1-2.
SEED_TOPOLOGY: dict[str, list[tuple[int, int]]] = {
    "leader": [(1, 0), (2, 0)],
    "w1-0": [(1, 1)],
    "w1-1": [(1, 2)],
    "w2-0": [(2, 1)],
    "w2-1": [(2, 2)],
}


def seed_table(
    base_port: int,
    revision: int = 1,
    epochs: dict[str, int] | None = None,
    worlds: Sequence[str] = ("world1", "world2"),
) -> WorldTable:
    """The seed topology as a world table (world W at base_port + W)."""
    entries = []
    for name in worlds:
        index = int(name.removeprefix("world"))
        pods = [pod for pod, member_worlds in SEED_TOPOLOGY.items() for i, _ in member_worlds if i == index]
        entries.append(
            WorldEntry(
                name=name,
                epoch=(epochs or {}).get(name, 1),
                backend="gloo",
                host="127.0.0.1",
                port=base_port + index,
                pods=pods,
            )
        )
    return WorldTable(revision=revision, worlds=entries)


def member_env(table: WorldTable, pod: str, table_url: str) -> dict[str, str]:
    """The contract environment a platform gives `pod`: its worlds in `table`, and where the
    live table comes from ("" for none)."""
    worlds = list(table.assignments_for(pod).values())
    return WorkerEnv(pod=pod, worlds=worlds, table=table_url).to_env()


def load_example_module(path: Path, name: str) -> ModuleType:
    """A module of the examples, loaded from its file as `name` (the examples are no package);
    its folder goes on sys.path for the modules beside it that it imports."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_common() -> ModuleType:
    """The examples' shared module."""
    return load_example_module(EXAMPLES / "common.py", "examples_common")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base_port(worlds: int = 2) -> int:
    """A base port whose next `worlds` ports (and itself) are free now."""
    for _ in range(200):
        base = random.randint(20000, 60000)
        if all(_bindable(base + i) for i in range(worlds + 1)):
            return base
    raise RuntimeError("no free port range found")


class ExampleProcess:
    """One example process; a thread collects its output lines (stdout and stderr merged)."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for_line(self, line: str, timeout: float = START_TIMEOUT) -> None:
        """Until the process printed exactly `line`."""
        self._wait_for(lambda: line in self.lines, repr(line), timeout)

    def wait_for_line_starting(self, prefix: str, timeout: float = START_TIMEOUT) -> None:
        """Until the process printed a line that starts with `prefix`."""
        self._wait_for(lambda: any(line.startswith(prefix) for line in self.lines), f"a line {prefix!r}...", timeout)

    def _wait_for(self, printed: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not printed():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"{self.name} never printed {what}:\n{self.output()}")
                self._changed.wait(min(remaining, 0.5))

    def wait(self, timeout: float = EXIT_TIMEOUT) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout} s:\n{self.output()}") from None
        self._reader.join(timeout)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)

    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)


def worldinfo_args(worlds: Iterable[tuple[int, int]]) -> list[str]:
    return [arg for index, rank in worlds for arg in ("--worldinfo", f"{index},{rank}")]


def example_script(example: str) -> str:
    return str(EXAMPLES / example / "main.py")


# The backends the examples run on here: gloo everywhere, NCCL only where CUDA is.
BACKENDS = [
    "gloo",
    pytest.param("nccl", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA device")),
]


def backend_env(backend: str, name: str) -> dict[str, str]:
    """What `multiworld run` gives a process of NCCL worlds: its GPU and, with fewer GPUs than
    processes, a host id of its own (see gpu_env)."""
    if backend != "nccl":
        return {}
    return gpu_env(name, list(SEED_TOPOLOGY).index(name), len(SEED_TOPOLOGY), torch.cuda.device_count())


def start_seed_topology(example: str, flags: Sequence[str], backend: str = "gloo") -> dict[str, ExampleProcess]:
    """The five processes of the seed topology, each given its --worldinfo, `--backend` and
    `flags`."""
    script = example_script(example)
    return {
        name: ExampleProcess(
            name, [script, *worldinfo_args(worlds), "--backend", backend, *flags], backend_env(backend, name)
        )
        for name, worlds in SEED_TOPOLOGY.items()
    }


def start_from_table(
    example: str, table: WorldTable, flags: Sequence[str], table_url: str = ""
) -> dict[str, ExampleProcess]:
    """The five processes of the seed topology, their worlds from the contract environment
    (`table`, and the live table at `table_url` when one is given) instead of --worldinfo."""
    return {
        pod: ExampleProcess(pod, [example_script(example), *flags], member_env(table, pod, table_url))
        for pod in SEED_TOPOLOGY
    }


def stop_all(processes: Iterable[ExampleProcess]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.proc.wait()


def finish(processes: dict[str, ExampleProcess]) -> dict[str, int]:
    """Every process's exit code, once all exited; on a failure (a hang) the rest are killed."""
    try:
        return {name: process.wait() for name, process in processes.items()}
    finally:
        stop_all(processes.values())


def assert_all_exit_zero(processes: dict[str, ExampleProcess]) -> None:
    codes = finish(processes)
    assert codes == dict.fromkeys(processes, 0), {n: p.output() for n, p in processes.items()}
