"""The builds `make test` runs beside the suite: the test cluster's binaries and our images.

On a new machine they take minutes (a Kubernetes build, two image builds), which the tests that
need neither use: `make test` starts them in the background (niced, their log in the file that
MULTIWORLD_BUILDS names, their exit status then in `<log>.rc`) and the suite runs the tests that
need no API server first. A test marked `kube` (an API server, a node or our images) or `quiet`
(a bench's timings, which a compile beside them would skew) waits here until the builds end, and
fails with their log's tail when they failed. Unset (pytest run by
hand, `make kube-binaries images` done before): nothing to wait for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

ENV_BUILDS = "MULTIWORLD_BUILDS"
# The longest a test waits: a Kubernetes build and both images on two busy cores, cold.
WAIT_S = 2400.0
PROGRESS_S = 60.0
_POLL_S = 1.0


class BuildsFailed(RuntimeError):
    """The builds ended with an error; the message holds their log's tail."""


def status_file(log: Path) -> Path:
    return log.with_name(log.name + ".rc")


def wait_for_builds(say: Callable[[str], None], timeout: float = WAIT_S) -> None:
    """Return once the background builds of `make test` (if any) have ended well; say so as it
    waits, every PROGRESS_S. BuildsFailed when they failed or did not end within `timeout`."""
    named = os.environ.get(ENV_BUILDS)
    if not named:
        return
    log = Path(named)
    began = time.monotonic()
    said = began - PROGRESS_S
    while (status := _status(log)) is None:
        waited = time.monotonic() - began
        if waited > timeout:
            raise BuildsFailed(f"the builds did not end within {timeout:.0f} s (log: {log}){_tail(log)}")
        if time.monotonic() - said >= PROGRESS_S:
            said = time.monotonic()
            say(f"waiting for the builds of the test cluster and our images ({waited:.0f} s so far; log: {log})")
        time.sleep(_POLL_S)
    if status != 0:
        raise BuildsFailed(f"the test cluster's and our images' builds failed (exit {status}, log {log}){_tail(log)}")


def _status(log: Path) -> int | None:
    """The builds' exit status, None while they run (the status file is written as they end)."""
    try:
        text = status_file(log).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def _tail(log: Path, lines: int = 30) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return "; its end:\n" + "\n".join(text.splitlines()[-lines:])
