"""A warm spare: a Python process that has already imported torch and the worker library,
waiting to become a member. Replacing a dead member then costs no interpreter start and no
torch import (most of a local recovery otherwise).

Protocol, over the spare's stdin/stdout pipes: once warm it writes one line "ready"; then it
reads one JSON line {"argv", "env", "cwd", "log"}, points stdout/stderr at the member's log,
takes the member's environment, directory and argv, and runs the script as `__main__`.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def _become(order: dict) -> None:
    fd = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    script = order["argv"][1]
    sys.argv = order["argv"][1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))


def main() -> None:
    import torch  # noqa: F401  (the point: pay the import before anyone waits for it)

    import multiworld.world  # noqa: F401

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line:
        return  # the runner went away before needing this spare
    _become(json.loads(line))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
