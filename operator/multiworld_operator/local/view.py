"""The live status of every world while `multiworld run` runs.

On a terminal the table is redrawn in place; elsewhere (CI, pipes) a line is logged whenever a
world's row changes, so the output stays quiet and readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from multiworld_operator.planner import MultiWorldStatus
from multiworld_operator.spec import MultiWorld
from multiworld_operator.text_columns import aligned


@dataclass(frozen=True)
class WorldRow:
    name: str
    phase: str
    epoch: int
    ready: int
    size: int
    restarts: int
    errors: int

    def cells(self) -> list[str]:
        return [
            self.name,
            self.phase,
            str(self.epoch),
            f"{self.ready}/{self.size}",
            str(self.restarts),
            str(self.errors),
        ]


def world_rows(
    multiworld: MultiWorld, status: MultiWorldStatus | None, errors_of: Callable[[str], int]
) -> list[WorldRow]:
    """A row per world of `multiworld`, as `status` has it (Pending before the first plan)."""
    rows = []
    for world in multiworld.spec.worlds:
        ws = status.worlds.get(world.name) if status else None
        rows.append(
            WorldRow(
                name=world.name,
                phase=ws.phase if ws else "Pending",
                epoch=ws.epoch if ws else 1,
                ready=ws.ready_ranks if ws else 0,
                size=len(multiworld.world_pods(world.name)),
                restarts=ws.restarts if ws else 0,
                errors=errors_of(world.name),
            )
        )
    return rows


HEADER = ["WORLD", "PHASE", "EPOCH", "RANKS UP", "RESTARTS", "ERRORS"]


def format_table(rows: list[WorldRow]) -> list[str]:
    return aligned([HEADER] + [r.cells() for r in rows])


class LiveView:
    def __init__(self, title: str, out: TextIO = sys.stderr, live: bool | None = None) -> None:
        self._title = title
        self._out = out
        self._live = out.isatty() if live is None else live
        self._drawn = 0
        self._last: dict[str, WorldRow] = {}
        self._started = time.monotonic()

    def update(self, rows: list[WorldRow], note: str = "") -> None:
        if self._live:
            self._redraw(rows, note)
            return
        elapsed = time.monotonic() - self._started
        for row in rows:
            if self._last.get(row.name) != row:
                self._out.write(
                    f"[{elapsed:7.2f}s] {row.name}: {row.phase} epoch={row.epoch} "
                    f"ranks={row.ready}/{row.size} restarts={row.restarts} errors={row.errors}\n"
                )
                self._last[row.name] = row
        self._out.flush()

    def event(self, message: str) -> None:
        """A one-off line (a kill, a failure, a recovery) printed above the live table."""
        elapsed = time.monotonic() - self._started
        if self._live:
            self._clear()
        self._out.write(f"[{elapsed:7.2f}s] {message}\n")
        self._out.flush()

    def _clear(self) -> None:
        if self._drawn:
            self._out.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def _redraw(self, rows: list[WorldRow], note: str) -> None:
        self._clear()
        elapsed = time.monotonic() - self._started
        lines = [f"{self._title}  {elapsed:6.1f}s  {note}".rstrip()] + format_table(rows)
        self._out.write("\n".join(lines) + "\n")
        self._drawn = len(lines)
        self._out.flush()

    def close(self) -> None:
        self._drawn = 0
