"""What the router prints (a running line every second, a summary at the end) and, with
--trace, writes: one JSON line per event, with wall-clock times, for bench/serving.py."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ledger import Answer, Ledger

if TYPE_CHECKING:
    from torch import Tensor


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile (`fraction` in (0, 1]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f} ms"


def running_line(ledger: Ledger, lost: int, recent: Sequence[Answer], seconds: float) -> str:
    """Counts so far; rate and latency of the answers of the last `seconds`."""
    latencies = [a.latency for a in recent]
    return (f"served {len(ledger.answers)}/{ledger.total}  retried {ledger.retried}  lost {lost}  "
            f"req/s {len(recent) / seconds:.1f}  p50 {_ms(percentile(latencies, 0.5))}  "
            f"p99 {_ms(percentile(latencies, 0.99))}")


def summary_lines(ledger: Ledger, elapsed: float, checked: int, wrong: int) -> list[str]:
    answers = list(ledger.answers.values())
    latencies = [a.latency for a in answers]
    lines = [
        f"summary: served {len(answers)} of {ledger.total} requests in {elapsed:.2f} s "
        f"({len(answers) / elapsed:.1f} req/s); retried {ledger.retried}, lost {ledger.unanswered}, "
        f"duplicates {ledger.duplicates}",
        f"  latency (arrival at the router to answer): p50 {_ms(percentile(latencies, 0.5))}, "
        f"p99 {_ms(percentile(latencies, 0.99))}, max {_ms(max(latencies, default=math.nan))}",
        f"  checked {checked} answers against the model run here: {wrong} wrong",
    ]
    by_epoch = Counter((a.world, a.epoch) for a in answers)
    for world in sorted({w for w, _ in by_epoch}):
        epochs = sorted((e, n) for (w, e), n in by_epoch.items() if w == world)
        detail = ", ".join(f"epoch {e}: {n}" for e, n in epochs)
        lines.append(f"  {world}: {sum(n for _, n in epochs)} answered ({detail})")
    return lines


class Trace:
    """JSON lines to a file, flushed with every running line (a run stopped from outside keeps
    what came before); does nothing without a file."""

    def __init__(self, path: Path | None) -> None:
        self._file: IO[str] | None = path.open("w") if path is not None else None

    def write(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, **fields}, separators=(",", ":")) + "\n")

    def answer(self, answer: Answer, logits: Tensor) -> None:
        """An answer, with the class the logits pick for each image of the request."""
        if self._file is not None:
            self.write("answer", id=answer.request, world=answer.world, epoch=answer.epoch, arrived=answer.arrived,
                       sent=answer.sent, done=answer.done, attempts=answer.attempts,
                       classes=logits.argmax(dim=1).tolist())

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
