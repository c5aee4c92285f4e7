"""The operator's metrics without an API server: what a step's two statuses count (a failure, a
recovery, each once), what a scrape of the real HTTP endpoint shows of a status, that a
deleted MultiWorld or a removed world leaves no series, and what scrapes cost (a render a
second however many ask, a status validated once per change). On the real node, a real
Prometheus scrapes the operator's pod (test_node_journeys.py); who may scrape, and the bounds on
connections: test_metrics_access.py and test_metrics_bounds.py."""

from __future__ import annotations

import http.client
import time
import urllib.request
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from multiworld_operator.kube.metrics import registry as metrics_module
from multiworld_operator.kube.metrics.registry import Key, OperatorMetrics, api_verb, transitions
from multiworld_operator.planner.status import StatusView
from tests.support.operator_metrics import T0, FixedStatuses, failure, planner_status as status

KEY = ("apps", "mw")


def test_a_failure_counts_when_seen_and_its_recovery_when_the_new_epoch_forms() -> None:
    formed = status(w={"phase": "Running", "epoch": 1, "formedAt": T0.isoformat()})
    failed = status(w={"phase": "Recovering", "epoch": 2, "restarts": 1, "lastFailure": failure(1)})
    back = status(
        w={"phase": "Running", "epoch": 2, "restarts": 1, "lastFailure": failure(1),
           "formedAt": (T0 + timedelta(seconds=2.5)).isoformat()},
    )  # fmt: skip
    assert transitions(formed, failed).failures == [("w", "PodFailed")]
    assert transitions(formed, failed).recoveries == []
    assert transitions(failed, back).failures == []
    assert transitions(failed, back).recoveries == [("w", 2.5)]
    assert transitions(back, back) == transitions(formed, formed)
    assert transitions(back, back).failures == [] and transitions(back, back).recoveries == []


def test_an_epoch_a_spec_edit_opened_is_no_recovery() -> None:
    """The last failure ended epoch 1; epoch 3 was opened by an edit: its forming is not a recovery."""
    before = status(w={"phase": "Pending", "epoch": 3, "restarts": 1, "lastFailure": failure(1)})
    after = status(
        w={"phase": "Running", "epoch": 3, "restarts": 1, "lastFailure": failure(1), "formedAt": T0.isoformat()}
    )
    assert transitions(before, after).recoveries == []


def test_a_worker_clock_behind_the_operators_counts_no_negative_recovery() -> None:
    before = status(w={"phase": "Recovering", "epoch": 2, "lastFailure": failure(1)})
    after = status(
        w={"phase": "Running", "epoch": 2, "lastFailure": failure(1),
           "formedAt": (T0 - timedelta(seconds=1)).isoformat()},
    )  # fmt: skip
    assert transitions(before, after).recoveries == [("w", 0.0)]


def test_api_verbs_are_kubernetes_verbs() -> None:
    methods = ["create_namespaced_pod", "read_namespaced_lease", "replace_namespaced_config_map",
               "patch_namespaced_custom_object_status", "delete_namespaced_pod", "list_namespaced_pod"]  # fmt: skip
    assert [api_verb(m) for m in methods] == ["create", "get", "update", "patch", "delete", "list"]


def scrape(port: int) -> dict[str, float]:
    """The endpoint's samples, by name and labels (sorted by label name)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            ordered = ",".join(sorted(labels.rstrip("}").split(","))) if labels else ""
            samples[f"{name}{{{ordered}}}" if ordered else name] = float(value)
    return samples


def series(name: str, **labels: str) -> str:
    """A sample's name as scrape() keys it."""
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


@pytest.fixture
def metrics() -> Iterator[OperatorMetrics]:
    made = OperatorMetrics()
    yield made
    made.close()


def test_the_endpoint_shows_each_world_as_its_status_does_and_forgets_what_is_gone(metrics: OperatorMetrics) -> None:
    before = status(w={"phase": "Running", "epoch": 1}, v={"phase": "Running", "epoch": 1})
    failed = status(
        w={"phase": "Recovering", "epoch": 2, "restarts": 1, "readyRanks": 1, "lastFailure": failure(1)},
        v={"phase": "Running", "epoch": 1, "readyRanks": 2},
    )
    back = status(
        w={"phase": "Running", "epoch": 2, "restarts": 1, "readyRanks": 2, "lastFailure": failure(1),
           "formedAt": (T0 + timedelta(seconds=3)).isoformat()},
        v={"phase": "Running", "epoch": 1, "readyRanks": 2},
    )  # fmt: skip
    shown: dict[Key, Mapping[str, Any] | None] = {KEY: {**back.view(), "spares": {"a": "1/2"}}, ("apps", "new"): None}
    metrics.read_statuses_from(FixedStatuses(shown, waiting=1))
    metrics.step_taken(KEY, before, failed)
    metrics.step_taken(KEY, failed, back)
    metrics.api_error("create_namespaced_pod", "409")
    port = metrics.serve(0, fresh_s=0)  # each scrape renders anew: this test follows changes at once

    samples = scrape(port)

    def of_w(name: str, **labels: str) -> float:
        return samples[series(name, namespace="apps", multiworld="mw", world="w", **labels)]

    assert of_w("multiworld_world_restarts_total") == 1
    assert of_w("multiworld_world_failures_total", reason="PodFailed") == 1
    assert of_w("multiworld_world_recovery_seconds_count") == 1
    assert of_w("multiworld_world_recovery_seconds_sum") == 3
    assert of_w("multiworld_world_phase", phase="Running") == 1
    assert of_w("multiworld_world_phase", phase="Recovering") == 0
    assert of_w("multiworld_world_epoch") == 2
    assert of_w("multiworld_world_ranks_ready") == 2
    assert samples[series("multiworld_spares_ready", namespace="apps", multiworld="mw", member="a")] == 1
    assert samples[series("multiworld_spares_wanted", namespace="apps", multiworld="mw", member="a")] == 2
    assert samples[series("multiworld_operator_api_errors_total", verb="create", code="409")] == 1
    assert samples["multiworld_operator_leader"] == 1 and samples["multiworld_operator_multiworlds_waiting"] == 1
    assert not [line for line in samples if 'multiworld="new"' in line]  # no status yet

    # World w removed from the spec: its counted series go; then the MultiWorld is deleted.
    metrics.step_taken(KEY, back, status(v={"phase": "Running", "epoch": 1}))
    assert not [series for series in scrape(port) if 'world="w"' in series and "failures" in series]
    metrics.forget(KEY)
    del shown[KEY]
    assert not [series for series in scrape(port) if 'multiworld="mw"' in series]


class CountingCollector(Collector):
    """A collector that counts the renders that asked it."""

    def __init__(self) -> None:
        self.renders = 0

    def collect(self) -> Iterator[Metric]:
        self.renders += 1
        yield from ()


def test_a_flood_of_scrapes_costs_a_render_a_second_not_one_each(metrics: OperatorMetrics) -> None:
    """Issue 32 finding 6: whoever scrapes, and however often, the exposition is rendered at
    most once a second (FRESH_S): scrapes as fast as four clients go, for 1.5 s."""
    counting = CountingCollector()
    metrics.registry.register(counting)
    metrics.read_statuses_from(FixedStatuses({KEY: status(w={"phase": "Running", "epoch": 1}).view()}))
    port = metrics.serve(0)
    start = time.monotonic()

    def scraper(source: str) -> int:
        """Scrapes one after the other from `source` (a connection at a time, as Prometheus)."""
        done = 0
        while time.monotonic() - start < 1.5:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
            connection.request("GET", "/metrics")
            assert b"multiworld_world_epoch{" in connection.getresponse().read()
            connection.close()
            done += 1
        return done

    with ThreadPoolExecutor(4) as pool:
        scrapes = sum(pool.map(scraper, [f"127.0.0.{1 + i}" for i in range(4)]))
    elapsed = time.monotonic() - start
    print(f"\n{scrapes} scrapes in {elapsed:.2f} s: {counting.renders} renders")
    assert scrapes >= 20
    assert counting.renders <= elapsed + 2, (scrapes, counting.renders)


def test_a_status_is_validated_once_per_change_not_per_render(monkeypatch: pytest.MonkeyPatch) -> None:
    """A status is validated when it is new (a write or a watch event makes a new object), not
    at every render: a tenant who may write its MultiWorld's status pays for its own writes."""
    validated: list[Mapping[str, Any]] = []

    class CountingView(StatusView):
        @classmethod
        def model_validate(cls, obj: Any, **kwargs: Any) -> StatusView:  # type: ignore[override]
            validated.append(obj)
            return StatusView.model_validate(obj, **kwargs)

    monkeypatch.setattr(metrics_module, "StatusView", CountingView)
    shown: dict[Key, Mapping[str, Any] | None] = {
        ("apps", name): status(w={"phase": "Running", "epoch": 1}).view() for name in ("a", "b")
    }
    metrics = OperatorMetrics()
    metrics.read_statuses_from(FixedStatuses(shown))
    for _ in range(5):
        generate_latest(metrics.registry)
    assert len(validated) == 2
    shown["apps", "a"] = status(w={"phase": "Running", "epoch": 2}).view()  # a new status of a
    exposition = generate_latest(metrics.registry).decode()
    assert len(validated) == 3
    assert 'multiworld_world_epoch{multiworld="a",namespace="apps",world="w"} 2.0' in exposition
