"""The worker's own Prometheus metrics, per world, served when MULTIWORLD_METRICS_PORT is set.

Unset, they cost nothing: prometheus_client is never imported, `recorder` gives None (a world
keeps it, so an op pays one None check) and the other hooks return after one check. The first
WorldManager given a port calls `serve`, which makes the metrics in a registry of this module's
own and serves them in Prometheus' text format on every address, from a daemon thread, for the
rest of the process, with bounds on what a connection may cost (metrics_server.py, loaded only
then). Importing this module starts nothing.

- `multiworld_worker_ops_total{world,op}`: ops issued through a world's API (ops.py; `op` is
  the method's name);
- `multiworld_worker_op_duration_seconds{world,op}`: issued to completed, for the ops that
  completed (a blocking op when it returns, an async one when its Work settles without error);
- `multiworld_worker_breaks_total{world}`: breaks this worker reported (worker_status.py);
- `multiworld_worker_joins_total{world}`: worlds joined, at any epoch (joining.py);
- `multiworld_worker_heartbeat_misses_total{world}`: heartbeat readings that found a peer
  process's counter still for more than two heartbeat intervals (detector.py).

No torch.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from multiworld.contract import ENV_METRICS_PORT

if TYPE_CHECKING:
    from prometheus_client import Counter, Histogram

# From a small collective between processes of one host to one that waits long for a slow
# peer; what takes longer than a minute counts in +Inf alone.
OP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _Metrics:
    """The metrics of this process, in a registry of their own, served on `port`."""

    def __init__(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

        from multiworld import metrics_server

        self.port = port
        registry = CollectorRegistry()

        def counter(name: str, help_text: str, *labels: str) -> Counter:
            return Counter(name, help_text, labels, registry=registry)

        self.ops = counter("multiworld_worker_ops_total", "Ops issued through the world's API.", "world", "op")
        self.durations = Histogram(
            "multiworld_worker_op_duration_seconds",
            "Seconds from an op's issue to its completion (ops that completed).",
            ("world", "op"),
            buckets=OP_BUCKETS,
            registry=registry,
        )
        self.breaks = counter("multiworld_worker_breaks_total", "Breaks of the world this worker reported.", "world")
        self.joins = counter("multiworld_worker_joins_total", "Times this worker joined the world.", "world")
        self.misses = counter(
            "multiworld_worker_heartbeat_misses_total",
            "Heartbeat readings that found a peer process's counter still for over two intervals.",
            "world",
        )
        try:
            metrics_server.start(lambda: generate_latest(registry), port)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot serve the worker's metrics on port {port} ({ENV_METRICS_PORT}): {exc.strerror}"
            ) from exc


_metrics: _Metrics | None = None
_lock = threading.Lock()


def serve(port: int) -> None:
    """Make the metrics and serve them on `port` (all addresses), once per process: a later call
    with the same port does nothing, one with another port raises ValueError."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = _Metrics(port)
        elif _metrics.port != port:
            raise ValueError(f"this process serves its metrics on port {_metrics.port} already, not {port}")


class OpRecorder:
    """One world's op metrics: `issued` when an op is handed to the communicator (it returns the
    op's start), `done` with that start when the op completed."""

    __slots__ = ("_world", "_metrics", "_counts", "_durations")

    def __init__(self, world: str, metrics: _Metrics) -> None:
        self._world = world
        self._metrics = metrics
        # Each op's own series, looked up once: a labels() call takes the metric's lock.
        self._counts: dict[str, Counter] = {}
        self._durations: dict[str, Histogram] = {}

    def issued(self, op: str) -> float:
        count = self._counts.get(op)
        if count is None:
            # The duration's series first: a thread that finds the count's finds it too.
            self._durations[op] = self._metrics.durations.labels(self._world, op)
            count = self._counts[op] = self._metrics.ops.labels(self._world, op)
        count.inc()
        return time.perf_counter()

    def done(self, op: str, started: float) -> None:
        self._durations[op].observe(time.perf_counter() - started)


def recorder(world: str) -> OpRecorder | None:
    """The op metrics of `world` (None while this process serves no metrics)."""
    metrics = _metrics
    return None if metrics is None else OpRecorder(world, metrics)


def world_joined(world: str) -> None:
    if _metrics is not None:
        _metrics.joins.labels(world).inc()


def world_broke(world: str) -> None:
    if _metrics is not None:
        _metrics.breaks.labels(world).inc()


def heartbeat_missed(world: str) -> None:
    if _metrics is not None:
        _metrics.misses.labels(world).inc()
