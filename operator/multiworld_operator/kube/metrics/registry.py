"""The operator's Prometheus metrics, served on `--metrics-port` (README, "Monitoring").

What a MultiWorld's status says (phases, epochs, ranks, restarts, spares, rollout) is read at
scrape time from the statuses this replica knows (`StatusSource`), so a scrape always matches
`kubectl get mw` and a deleted MultiWorld leaves no series behind; a standby replica shows them
too, from its watch. A status is validated once per change (a tenant may write its status: one
it rewrites costs a validation per render, not per scrape), and the exposition is rendered at
most once a second whoever scrapes (server.py, which serves it to a bearer token allowed
`get` on /metrics). What the status does not keep (each failure by reason, each recovery's
duration, each step's duration, each API error) is counted as it happens, by the replica that
leads at the time: sum over replicas where one took over from another.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import ValidationError

from multiworld_operator.kube.metrics.access import MetricsAccess
from multiworld_operator.kube.metrics.server import FRESH_S, MetricsServer
from multiworld_operator.planner import MultiWorldStatus
from multiworld_operator.planner.status import Phase, StatusView, WorldPhase

Key = tuple[str, str]
# From a failure seen to every rank back: a restart with no backoff takes seconds; backoffs and
# new pods (image pulls, model loads) take minutes.
RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# One reconcile step: milliseconds for a small MultiWorld, seconds for thousands of pods.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The Kubernetes verb of each client method, by its name's first word.
_VERBS = {"read": "get", "list": "list", "create": "create", "replace": "update", "patch": "patch", "delete": "delete"}
WORLD_LABELS = ("namespace", "multiworld", "world")


class StatusSource(Protocol):
    """What the metrics read at scrape time: every known MultiWorld's status as last written or
    watched, whether this replica leads, and how many MultiWorlds wait for a step."""

    @property
    def leading(self) -> bool: ...

    def statuses(self) -> Iterable[tuple[Key, Mapping[str, Any] | None]]: ...

    def waiting(self) -> int: ...


@dataclass(frozen=True)
class Transitions:
    """What one step changed that the status does not count: new failures (world, reason) and
    recoveries completed (world, seconds from the failure seen to the last rank joined)."""

    failures: list[tuple[str, str]]
    recoveries: list[tuple[str, float]]


def transitions(before: MultiWorldStatus | None, after: MultiWorldStatus) -> Transitions:
    """Compare the planner's memory before and after a step (pure)."""
    failures, recoveries = [], []
    for name, world in after.worlds.items():
        old = before.worlds.get(name) if before is not None else None
        failure = world.last_failure
        if failure is None:
            continue
        if old is None or old.last_failure != failure:
            failures.append((name, failure.reason))
        # The epoch that the failure opened formed now: the recovery ends at its last join.
        newly_formed = world.formed_at is not None and (old is None or old.formed_at != world.formed_at)
        if newly_formed and world.epoch == failure.epoch + 1 and world.formed_at is not None:
            recoveries.append((name, max(0.0, (world.formed_at - failure.time).total_seconds())))
    return Transitions(failures, recoveries)


def api_verb(method_name: str) -> str:
    """The Kubernetes verb of a client method (`create_namespaced_pod` -> create)."""
    return _VERBS.get(method_name.split("_", 1)[0], method_name)


class OperatorMetrics:
    """One replica's metrics, in a registry of their own (several operators may share a test
    process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.step_duration = Histogram(
            "multiworld_operator_step_duration_seconds",
            "Duration of one reconcile step of one MultiWorld (observe, plan, execute, store), failed ones too.",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.api_errors = Counter(
            "multiworld_operator_api_errors",
            "Kubernetes API calls that failed, by verb and HTTP status (transport: no answer); includes "
            "the 404 and 409 answers that idempotent creates, reads and deletes expect.",
            ["verb", "code"],
            registry=self.registry,
        )
        self.failures = Counter(
            "multiworld_world_failures",
            "World epochs that ended in a failure, by reason (PodFailed, PodDeleted, WorldBroken, PodReplaced).",
            [*WORLD_LABELS, "reason"],
            registry=self.registry,
        )
        self.recovery = Histogram(
            "multiworld_world_recovery_seconds",
            "From a world's failure seen by the operator to its last rank joined the new epoch.",
            WORLD_LABELS,
            buckets=RECOVERY_BUCKETS,
            registry=self.registry,
        )
        # The label sets counted per MultiWorld, so that a deleted one (or a removed world) leaves none.
        self._counted: dict[Key, set[tuple[str, str]]] = {}
        self.server: MetricsServer | None = None

    def read_statuses_from(self, source: StatusSource) -> None:
        self.registry.register(_StatusCollector(source))

    def serve(self, port: int, access: MetricsAccess | None = None, fresh_s: float = FRESH_S) -> int:
        """Serve /metrics on every address, over TLS to the tokens `access` allows (None: plain
        HTTP to anyone), rendered at most once per `fresh_s`; the port listened on (`port` 0: a
        free one)."""
        self.server = MetricsServer(lambda: generate_latest(self.registry), access, fresh_s)
        return self.server.start("0.0.0.0", port)

    def close(self) -> None:
        """Stop serving."""
        if self.server is not None:
            self.server.close()

    def api_error(self, method_name: str, code: str) -> None:
        self.api_errors.labels(api_verb(method_name), code).inc()

    def step_taken(self, key: Key, before: MultiWorldStatus | None, after: MultiWorldStatus) -> None:
        """Count what the step changed; forget the series of worlds the spec no longer has."""
        counted = self._counted.setdefault(key, set())
        found = transitions(before, after)
        for world, reason in found.failures:
            self.failures.labels(*key, world, reason).inc()
            counted.add((world, reason))
        for world, seconds in found.recoveries:
            self.recovery.labels(*key, world).observe(seconds)
            counted.add((world, ""))
        for world, reason in [entry for entry in counted if entry[0] not in after.worlds]:
            self._remove(key, world, reason)
            counted.discard((world, reason))

    def forget(self, key: Key) -> None:
        """The MultiWorld is gone: its series go."""
        for world, reason in self._counted.pop(key, set()):
            self._remove(key, world, reason)

    def _remove(self, key: Key, world: str, reason: str) -> None:
        # KeyError: that label set was never created in this metric (a failure with no recovery yet).
        try:
            if reason:
                self.failures.remove(*key, world, reason)
            else:
                self.recovery.remove(*key, world)
        except KeyError:
            pass


class _StatusCollector(Collector):
    """The gauges and counters a MultiWorld's status holds, read at scrape time."""

    def __init__(self, source: StatusSource) -> None:
        self.source = source
        # Per MultiWorld: the status last validated (the very object) and its view.
        self._views: dict[Key, tuple[Mapping[str, Any] | None, StatusView | None]] = {}

    def _validated(self) -> Iterator[tuple[Key, StatusView]]:
        """Every status the source knows as a view, each validated once per change (a new
        object: a write, a watch event) and forgotten with its MultiWorld."""
        views = {}
        for key, shown in self.source.statuses():
            known = self._views.get(key)
            views[key] = known if known is not None and known[0] is shown else (shown, _view(shown))
        self._views = views
        for key, (_, view) in views.items():
            if view is not None:
                yield key, view

    def collect(self) -> Iterator[Metric]:
        world_phase = GaugeMetricFamily(
            "multiworld_world_phase", "1 for the world's current phase, 0 for the others.",
            labels=[*WORLD_LABELS, "phase"],
        )  # fmt: skip
        epoch = GaugeMetricFamily("multiworld_world_epoch", "The world's current epoch.", labels=WORLD_LABELS)
        ranks = GaugeMetricFamily("multiworld_world_ranks", "Ranks (pods) of the world.", labels=WORLD_LABELS)
        ready = GaugeMetricFamily(
            "multiworld_world_ranks_ready", "Ranks ready at the world's current epoch.", labels=WORLD_LABELS
        )
        restarts = CounterMetricFamily(
            "multiworld_world_restarts", "Restarts of the world (epochs opened by a failure).", labels=WORLD_LABELS
        )
        phase = GaugeMetricFamily(
            "multiworld_phase", "1 for the MultiWorld's current phase, 0 for the others.",
            labels=["namespace", "multiworld", "phase"],
        )  # fmt: skip
        spares_ready = GaugeMetricFamily(
            "multiworld_spares_ready", "Warm spares ready per member.", labels=["namespace", "multiworld", "member"]
        )
        spares_wanted = GaugeMetricFamily(
            "multiworld_spares_wanted", "Warm spares wanted per member.", labels=["namespace", "multiworld", "member"]
        )
        rollout_updated = GaugeMetricFamily(
            "multiworld_rollout_pods_updated",
            "While a rollout runs: the member's pods made from its current template.",
            labels=["namespace", "multiworld", "member"],
        )
        rollout_pods = GaugeMetricFamily(
            "multiworld_rollout_pods",
            "While a rollout runs: the member's pods.",
            labels=["namespace", "multiworld", "member"],
        )
        for (namespace, name), status in self._validated():
            for phase_name in get_args(Phase):
                phase.add_metric([namespace, name, phase_name], float(status.phase == phase_name))
            for world_name, world in status.worlds.items():
                labels = [namespace, name, world_name]
                for world_phase_name in get_args(WorldPhase):
                    world_phase.add_metric([*labels, world_phase_name], float(world.phase == world_phase_name))
                epoch.add_metric(labels, world.epoch)
                ranks.add_metric(labels, world.size)
                ready.add_metric(labels, world.ready_ranks)
                restarts.add_metric(labels, world.restarts)
            for member, fraction in status.spares.items():
                have, want = _fraction(fraction)
                spares_ready.add_metric([namespace, name, member], have)
                spares_wanted.add_metric([namespace, name, member], want)
            for member, fraction in status.rollout.items():
                have, want = _fraction(fraction)
                rollout_updated.add_metric([namespace, name, member], have)
                rollout_pods.add_metric([namespace, name, member], want)
        yield from (world_phase, epoch, ranks, ready, restarts, phase)
        yield from (spares_ready, spares_wanted, rollout_updated, rollout_pods)
        yield GaugeMetricFamily(
            "multiworld_operator_leader", "1 while this replica leads (acts), 0 while it stands by.",
            value=float(self.source.leading),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "multiworld_operator_multiworlds_waiting",
            "MultiWorlds woken for a step that has not started yet.",
            value=self.source.waiting(),
        )


def _view(shown: Mapping[str, Any] | None) -> StatusView | None:
    """A status as the CR shows it; None before the first step, or one a newer operator wrote
    in a shape this one cannot read."""
    if not shown:
        return None
    try:
        return StatusView.model_validate(shown)
    except ValidationError:
        return None


def _fraction(text: str) -> tuple[float, float]:
    """ "3/4" -> (3, 4)."""
    have, _, want = text.partition("/")
    return float(have), float(want or 0)
