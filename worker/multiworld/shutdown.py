"""Process exit that neither waits out a stuck communicator nor crashes (no torch here).

At interpreter exit CPython (3.11) ends daemon threads that try to take the GIL with
pthread_exit; a thread coming back from torch C++ code at that moment (a communicator's
destructor, a wait, a gloo completion calling a Python callback) is unwound through noexcept
frames and the process aborts. So every library thread that touches torch is started with
`start_thread`, and at exit: every manager is closed (which stops those threads or lets them
finish), then the exit waits (bounded) for them. If one is stuck on a silent peer, the process
ends with os._exit after flushing, with the exit status the program asked for.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

log = logging.getLogger(__name__)

# How long the exit waits for communicators to wind down before it stops waiting.
EXIT_GRACE = 2.0

_cond = threading.Condition()
_busy = 0
_closers: list[Callable[[], None]] = []
_status: int | None = None
_hooks_installed = False


def start_thread(target: Callable[..., None], name: str, *args: Any) -> threading.Thread:
    """Start a daemon thread that may call into torch; the exit waits for it (bounded)."""
    global _busy
    with _cond:
        _busy += 1

    def run() -> None:
        global _busy
        try:
            target(*args)
        finally:
            with _cond:
                _busy -= 1
                _cond.notify_all()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def quiet(timeout: float) -> bool:
    """True once every thread from `start_thread` has ended (waiting up to `timeout`)."""
    deadline = time.monotonic() + timeout
    with _cond:
        while _busy:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _cond.wait(left)
        return True


def on_exit(closer: Callable[[], None]) -> None:
    """Run `closer` at interpreter exit, before waiting for quiet (once, however often it is
    asked for). The first call installs the exit hooks; until then this module changes nothing
    in the process."""
    with _cond:
        if closer in _closers:
            return
        _closers.append(closer)
    _install_hooks()


def _record(status: int) -> None:
    global _status
    if _status is None:
        _status = status


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # Python prints a non-int exit argument and exits with 1


def _install_hooks() -> None:
    """Close and wait at interpreter exit (`_at_exit`), and remember the exit status the program
    asks for, in case exit has to use os._exit."""
    global _hooks_installed
    with _cond:
        if _hooks_installed:
            return
        _hooks_installed = True
    atexit.register(_at_exit)
    previous_hook = sys.excepthook
    previous_exit = sys.exit

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _record(130 if issubclass(kind, KeyboardInterrupt) else 1)
        previous_hook(kind, value, tb)

    def exit(status: Any = None) -> NoReturn:  # stands in for sys.exit
        _record(_exit_code(status))
        previous_exit(status)

    sys.excepthook = excepthook
    sys.exit = exit


def end_process(status: int) -> NoReturn:
    """End the process now with `status` (pymultiworld's cleanup): close every manager, wait
    (bounded) for the library's threads, flush, os._exit. Nothing after this call runs."""
    _close_all()
    quiet(EXIT_GRACE)
    _exit_now(status)


def _close_all() -> None:
    for closer in list(_closers):
        try:
            closer()
        except Exception:
            log.exception("closing at exit failed")


def _exit_now(status: int) -> NoReturn:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


def _at_exit() -> None:
    _close_all()
    if quiet(EXIT_GRACE):
        return
    status = _status if _status is not None else 0
    log.warning("a communicator is stuck on a silent peer; ending the process now (status %d)", status)
    _exit_now(status)
