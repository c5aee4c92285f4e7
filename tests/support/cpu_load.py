"""Busy processes that saturate the cores (bench/failover.py's --load, and the worker test that
checks no verdict falls on saturated cores), and the CPU a process took. No torch here: the
torch load runs in its own processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

# Pure Python (it holds its GIL, its own), and torch matmuls on one thread.
PURE_PYTHON = "print('ready', flush=True)\nwhile True:\n    pass"
MATMULS = (
    "import torch\ntorch.set_num_threads(1)\na = torch.rand(256, 256)\nprint('ready', flush=True)\n"
    "while True:\n    a @ a"
)


def cpu_seconds(pid: int) -> float:
    """User + system time of a process so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class BusyProcesses:
    """`count` busy processes, alternately pure Python and torch matmuls, each on one thread;
    children of this process, in its session. Busy once made; `stop` (or leaving the `with`)
    kills them."""

    def __init__(self, count: int) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            for i in range(count):
                code = (PURE_PYTHON, MATMULS)[i % 2]
                self.procs.append(
                    subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
                )
            for proc in self.procs:
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a busy process ended before it was busy (exit {proc.wait()})")
        except BaseException:
            self.stop()
            raise
        self.started = time.monotonic()
        self._cpu_at_start = self._cpu()

    def _cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs)

    def cores(self) -> float:
        """The CPU they took since all were busy, in cores."""
        if not self.procs:
            return 0.0
        return (self._cpu() - self._cpu_at_start) / (time.monotonic() - self.started)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(30)

    def __enter__(self) -> BusyProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
