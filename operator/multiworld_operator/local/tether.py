"""No member process outlives its `multiworld run`, whatever the runner dies of.

Ctrl-C, SIGTERM and SIGHUP stop the members cleanly (commands/run.py). A runner killed by
SIGKILL, or crashing, cannot: its members, each the leader of its own session, would go on
under init. So each run starts one small watchdog process that holds the read end of a pipe
from the runner and the process groups of the run's members as the runner tells it
(`+PGID`, `-PGID`). The pipe reaches end-of-file only when the runner is gone (the kernel
closes it whatever the cause); the watchdog then SIGKILLs every group it still holds. The
watchdog leads a session of its own, so the terminal's Ctrl-C or hang-up does not reach it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


class Tether:
    """The runner's end: tells the watchdog which process groups to kill if the runner dies."""

    def __init__(self) -> None:
        self.watchdog = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self.watchdog.stdin is not None
        self.pipe = self.watchdog.stdin

    def _tell(self, line: str) -> None:
        try:
            self.pipe.write(f"{line}\n".encode())
            self.pipe.flush()
        except (BrokenPipeError, ValueError):
            # The watchdog is gone (killed by hand) or closed: the run goes on without it.
            pass

    def hold(self, pgid: int) -> None:
        """Kill group `pgid` if the runner dies from now on."""
        self._tell(f"+{pgid}")

    def release(self, pgid: int) -> None:
        """Group `pgid` is reaped: its number may be reused by another group."""
        self._tell(f"-{pgid}")

    def close(self) -> None:
        """The run ended with its groups released: the watchdog exits, killing nothing."""
        if not self.pipe.closed:
            self.pipe.close()
        self.watchdog.wait()


def watch() -> None:
    """The watchdog: follow the runner's lines on stdin; at end-of-file kill what is held."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    held: set[int] = set()
    for line in iter(sys.stdin.buffer.readline, b""):
        text = line.strip().decode()
        if text[:1] == "+":
            held.add(int(text[1:]))
        elif text[:1] == "-":
            held.discard(int(text[1:]))
    for pgid in held:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    watch()
