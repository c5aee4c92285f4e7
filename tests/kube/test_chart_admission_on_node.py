"""The chart's admission with its defaults, on the real nodes (issue 32, finding 1): two replicas,
`webhook.failurePolicy: Fail`, the operator image as the Deployment runs it. From the moment
`helm install --wait` returns, through a rolling update and through a replica deleted, every
request the API server sends to the webhook is answered: a valid MultiWorld is admitted and an
invalid one refused by the webhook's own words, never an x509 error or a refused connection.

The test cluster runs Kubernetes 1.20, which does not label a namespace with its name as 1.21
and later do (`kubernetes.io/metadata.name`, what the chart's webhook selects the watched
namespaces by): the test labels its namespace so, before the install.

The requests are server-side dry runs (`dryRun=All`): the API server calls the webhook exactly
as for a real create, and nothing is stored, so each probe is one request and leaves nothing."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.cluster import operator_release
from tests.cluster.cluster import Cluster
from tests.support.node_support import WAIT_S
from tests.support.operator_support import GROUP, PLURAL, VERSION, two_worlds

pytestmark = [pytest.mark.kube, pytest.mark.node]

PROBE_INTERVAL_S = 0.2
# After the last old replica is gone: the Service's endpoints and the API server's proxy rules
# follow the pods a little later, so the probes go on for this long.
SETTLE_S = 5.0


@dataclass
class Probes:
    """Admission requests sent one after another; what each got back."""

    custom: client.CustomObjectsApi
    namespace: str
    sent: int = 0
    failures: list[str] = field(default_factory=list)

    def one(self) -> None:
        """A valid MultiWorld must be admitted, an invalid one refused with the webhook's 422
        naming its field; anything else (the webhook unreachable, untrusted) is a failure."""
        self.sent += 1
        name = f"probe-{uuid.uuid4().hex[:8]}"
        try:
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, two_worlds(name), dry_run="All"
            )
        except ApiException as error:
            self.failures.append(f"valid {name}: {error.status} {error.body}")
        invalid = two_worlds(name)
        invalid["spec"]["worlds"][0]["ranks"].append("ghost")
        try:
            self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, invalid, dry_run="All")
            self.failures.append(f"invalid {name}: admitted")
        except ApiException as error:
            if error.status != 422 or "spec.worlds[0].ranks[2]" not in str(error.body):
                self.failures.append(f"invalid {name}: {error.status} {error.body}")

    def until(self, done: Any, timeout: float) -> None:
        """Probe until `done()` holds (and SETTLE_S more), failing the test past `timeout`."""
        deadline = time.monotonic() + timeout
        settled_at: float | None = None
        while settled_at is None or time.monotonic() < settled_at + SETTLE_S:
            assert time.monotonic() < deadline, f"not done within {timeout} s ({self.sent} probes sent)"
            self.one()
            if settled_at is None and done():
                settled_at = time.monotonic()
            time.sleep(PROBE_INTERVAL_S)


@dataclass(frozen=True)
class Release:
    apps: client.AppsV1Api
    core: client.CoreV1Api
    namespace: str
    fullname: str

    def pods(self) -> list[client.V1Pod]:
        selector = f"app.kubernetes.io/instance={self.fullname.removesuffix('-multiworld-operator')}"
        return list(self.core.list_namespaced_pod(self.namespace, label_selector=selector).items)

    def rolled_out(self, replicas: int, old: set[str]) -> bool:
        """Every replica of the current template ready, and none of `old` left (not even terminating)."""
        status = self.apps.read_namespaced_deployment(self.fullname, self.namespace).status
        pods = self.pods()
        return (
            (status.updated_replicas or 0) == replicas
            and (status.ready_replicas or 0) == replicas
            and (status.replicas or 0) == replicas
            and not {p.metadata.name for p in pods} & old
            and len(pods) == replicas
        )


@pytest.fixture
def release(kube_node: Cluster) -> Iterator[tuple[Release, Probes]]:
    """The chart installed with its defaults (but our image and one namespace watched) and
    `helm --wait`; the probes start the moment the install returns."""
    suffix = uuid.uuid4().hex[:6]
    namespace, apps, name = f"multiworld-{suffix}", f"apps-{suffix}", f"mw-{suffix}"
    with kube_node.api_client() as api:
        core = client.CoreV1Api(api)
        labels = {"kubernetes.io/metadata.name": apps}
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=apps, labels=labels)))
        operator_release.install(kube_node.kubeconfig, namespace, name, [apps], watch_only_those=True, wait=True)
        try:
            yield (
                Release(client.AppsV1Api(api), core, namespace, f"{name}-multiworld-operator"),
                Probes(client.CustomObjectsApi(api), apps),
            )
        finally:
            operator_release.uninstall(kube_node.kubeconfig, namespace, name)
            for gone in (apps, namespace):
                core.delete_namespace(gone)


def test_the_charts_defaults_admit_from_install_through_a_rolling_update_and_a_restart(
    release: tuple[Release, Probes],
) -> None:
    chart, probes = release
    replicas = chart.apps.read_namespaced_deployment(chart.fullname, chart.namespace).spec.replicas
    assert replicas == 2, "the chart's default is two replicas"

    # Right after `helm install --wait`: 20 probes in a row.
    for _ in range(20):
        probes.one()
    assert not probes.failures, probes.failures
    print(f"after install: {probes.sent} probes answered")

    # A rolling update (what `kubectl rollout restart` writes), probed until it is over.
    old = {p.metadata.name for p in chart.pods()}
    restarted = {"spec": {"template": {"metadata": {"annotations": {"test/restartedAt": str(time.time())}}}}}
    chart.apps.patch_namespaced_deployment(chart.fullname, chart.namespace, restarted)
    started = time.monotonic()
    probes.until(lambda: chart.rolled_out(replicas, old), WAIT_S)
    assert not probes.failures, f"{len(probes.failures)} of {probes.sent} probes failed: {probes.failures}"
    print(f"rolling update: {probes.sent} probes answered in all, {time.monotonic() - started:.1f} s of it")

    # One replica deleted as a node drain or a user would (its grace period kept).
    old = {chart.pods()[0].metadata.name}
    chart.core.delete_namespaced_pod(next(iter(old)), chart.namespace)
    started = time.monotonic()
    probes.until(lambda: chart.rolled_out(replicas, old), WAIT_S)
    assert not probes.failures, f"{len(probes.failures)} of {probes.sent} probes failed: {probes.failures}"
    print(f"a replica deleted: {probes.sent} probes answered in all, {time.monotonic() - started:.1f} s of it")
