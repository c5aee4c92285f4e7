"""Member processes: a child Python program whose stdout is JSON events (one object a line, its
name under "event"), read as they come, and whose stdin takes commands, one a line. The worker
tests run tests/worker/member.py this way, the benches their own members."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Generous: two busy cores, several processes importing torch at once.
WAIT_S = 90.0


class MemberFailed(AssertionError):
    """A member ended, or did not say what was awaited in time. An AssertionError: in a test it
    fails the test as any assertion does."""


def _signals_as_from_a_terminal() -> None:
    """In a member before exec: SIGINT and SIGQUIT at their defaults, as a program started from a
    terminal has them. A suite started in the background (`make test &`) inherits both ignored,
    and a member's reaction to Ctrl-C would go untested."""
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


class Member:
    """`python ARGV...` as member `name`, its environment this one's with `env` over it."""

    def __init__(
        self,
        argv: Sequence[str],
        name: str,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        wait_s: float = WAIT_S,
    ) -> None:
        self.name = name
        self.wait_s = wait_s
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=cwd,
            preexec_fn=_signals_as_from_a_terminal,
        )
        threading.Thread(target=self._read, name=f"read-{name}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()
        with self._cond:
            self.events.append({"event": "eof"})
            self._cond.notify_all()

    def stderr(self) -> str:
        """The end of what the member wrote on stderr."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def wait_for(self, name: str, timeout: float | None = None, **match: Any) -> dict[str, Any]:
        """The first event `name` whose fields include `match`."""
        timeout = self.wait_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events:
                    if event["event"] == name and all(event.get(k) == v for k, v in match.items()):
                        return event
                    if event["event"] == "eof":
                        raise MemberFailed(f"member {self.name} ended before {name} {match}:\n{self.stderr()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MemberFailed(
                        f"no {name} {match} from member {self.name} within {timeout:.0f}s:\n{self.stderr()}"
                    )
                self._cond.wait(left)

    def named(self, name: str) -> list[dict[str, Any]]:
        """Every event `name` so far."""
        with self._cond:
            return [e for e in self.events if e["event"] == name]

    def tell(self, command: str | Mapping[str, Any]) -> None:
        """One line on the member's stdin: a word, or a command as JSON."""
        line = command if isinstance(command, str) else json.dumps(command)
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait_exit(self, timeout: float | None = None) -> int:
        return self.proc.wait(self.wait_s if timeout is None else timeout)

    def kill(self) -> None:
        """SIGKILL (it also ends a SIGSTOPped member), and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
