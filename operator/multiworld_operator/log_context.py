"""Log lines that carry what they are about, bound once.

A reconcile loop binds its MultiWorld (`multiworld_bound`) around its steps, and the worker
channel around what a pod's worker said: every line logged within carries it, the API client's
included (a context variable: an asyncio task and `asyncio.to_thread` take a copy of it). A
line about one world adds it with `extra=about(world)`. Each record gets `multiworld`, `world`
and `epoch` attributes, for a structured formatter; the CLI's format (`configure`) ends the line
with those set, as ` [multiworld=NS/NAME world=W]`: the keys the worker logs under too
(`multiworld.log_context`), so one failure is followed from a worker's verdict to the
operator's step by `world=W`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

KEYS = ("multiworld", "world", "epoch")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(context)s"

_multiworld: ContextVar[str | None] = ContextVar("multiworld", default=None)


@contextmanager
def multiworld_bound(namespace: str, name: str) -> Iterator[None]:
    """Every line logged within (in this context, and the tasks and threads it starts) names the MultiWorld."""
    token = _multiworld.set(f"{namespace}/{name}")
    try:
        yield
    finally:
        _multiworld.reset(token)


def about(world: str | None, epoch: int | None = None) -> dict[str, object]:
    """`extra` for a line about one world (at one epoch)."""
    return {key: value for key, value in (("world", world), ("epoch", epoch)) if value is not None}


class ContextFilter(logging.Filter):
    """Sets each record's `multiworld` (the bound one unless given) and `context` (the keys set,
    as ` [key=value ...]`, or nothing)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "multiworld", None) is None:
            record.multiworld = _multiworld.get()
        pairs = [f"{key}={value}" for key in KEYS if (value := getattr(record, key, None)) is not None]
        record.context = f" [{' '.join(pairs)}]" if pairs else ""
        return True


def configure(level: int) -> None:
    """Log to stderr at `level`, each line ending with its bound keys."""
    logging.basicConfig(level=level, format=FORMAT)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter())
