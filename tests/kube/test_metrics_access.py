"""Who may read the operator's metrics, and what a flood of connections costs it (issue 32,
finding 6): they list every tenant's namespaces, MultiWorlds and world health. A real API server
answers the operator's TokenReviews and SubjectAccessReviews; the operator is `multiworld
operator --metrics-port` as a process of its own, with the chart's ServiceAccount and RBAC
(its ClusterRole, and the ClusterRole `<fullname>-metrics-reader` bound here to one
ServiceAccount only); every request comes from raw sockets, none from our code.

- No metrics in clear; no token or a junk one: 401; a ServiceAccount's token without the
  reader's binding: 403; a bound one: the metrics.
- A token's answer is remembered (a scrape every second costs no review); junk tokens from one
  source cost at most CHECK_BURST reviews at once.
- A real Prometheus scrapes them with its token in a file, as the chart's ServiceMonitor says.
- A flood from one source or 100 (127.0.0.2 and up), each connection re-opened the moment it is
  closed: the operator holds no more than MAX_CONNECTIONS of them and starts no thread for them,
  and a scrape still answers.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from multiworld_operator.kube.metrics.access import CHECK_BURST
from multiworld_operator.kube.metrics.server import ACCEPTS_AT_ONCE, MAX_CONNECTIONS
from multiworld_operator.kube.workers.channel_settings import ENV_CHANNEL_PORT
from tests.cluster import cluster as cluster_module
from tests.cluster.cluster import Cluster
from tests.support.metrics_support import get_metrics, service_account_token
from tests.support.operator_support import cluster_release, stop_operator
from tests.support.prometheus import Prometheus

pytestmark = pytest.mark.kube

STARTUP_S = 60.0
SCRAPES_UNDER_FLOOD = 5
SCRAPER = "127.0.1.1"
# How long a scrape may take under the flood (it is tried again until then).
SCRAPE_WITHIN_S = 5.0
# Threads an idle operator may start besides (its API client's pools grow on demand).
THREAD_SLACK = 4
# Its sockets besides the flood's: the API server's, for its watches and requests.
SOCKET_SLACK = 16

# A connection flooder that is not ours: each slot connects from its source, waits until the
# server closes the connection, and connects again at once (a connection refused at once may
# fail before it is made); it says how many connections it tried, each second.
FLOODER = r"""
import asyncio, sys
port, sources, per_source = (int(a) for a in sys.argv[1:4])
tried = 0

async def slot(source):
    global tried
    while True:
        tried += 1
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0)  # refused as it was made: again, once the others had a turn
            continue
        try:
            await reader.read(1)
        except OSError:
            pass
        writer.close()

async def main():
    slots = [slot(f"127.0.0.{2 + i}") for i in range(sources) for _ in range(per_source)]
    tasks = [asyncio.ensure_future(s) for s in slots]
    print("flooding", flush=True)
    while True:
        await asyncio.sleep(1)
        print(tried, flush=True)

asyncio.run(main())
"""


@dataclass(frozen=True)
class Served:
    """The operator's metrics port and process; the tokens of a ServiceAccount bound to the
    chart's metrics-reader ClusterRole and of one bound to nothing; the admin's client."""

    port: int
    process: subprocess.Popen[bytes]
    reader: str
    stranger: str
    api: client.ApiClient


@pytest.fixture(scope="module")
def served(kube_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    release = cluster_release(kube_cluster)
    namespace = f"metrics-{uuid.uuid4().hex[:6]}"
    port = cluster_module.free_port()
    log_path = tmp_path_factory.mktemp("metrics") / "operator.log"
    command = [sys.executable, "-m", "multiworld_operator.cli", "operator", "--namespace", namespace]
    env = {**os.environ, "KUBECONFIG": str(release.operator_kubeconfig), ENV_CHANNEL_PORT: "0"}
    with kube_cluster.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
        try:
            with (
                service_account_token(api, namespace, "prometheus", f"{release.fullname}-metrics-reader") as reader,
                service_account_token(api, namespace, "stranger", None) as stranger,
                open(log_path, "wb") as log,
            ):
                process = subprocess.Popen([*command, "--metrics-port", str(port)], env=env, stdout=log, stderr=log)
                try:
                    cluster_module.wait_for("the metrics port", lambda: _listening(port, process), STARTUP_S)
                    yield Served(port, process, reader, stranger, api)
                finally:
                    stop_operator(process)
        finally:
            core.delete_namespace(namespace)


def _listening(port: int, process: subprocess.Popen[bytes]) -> bool:
    assert process.poll() is None, f"the operator exited with {process.returncode}"
    try:
        with socket.create_connection(("127.0.0.1", port), 1):
            return True
    except OSError:
        return False


def in_clear(port: int) -> int | None:
    """The status a plain HTTP request for /metrics gets, without a token (None: no answer)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        return connection.getresponse().status
    except (http.client.HTTPException, ConnectionError):
        return None
    finally:
        connection.close()


REVIEW = re.compile(r'^apiserver_request_total\{[^}]*resource="(tokenreviews|subjectaccessreviews)"[^}]*\} (\S+)$')


def reviews(api: client.ApiClient) -> dict[str, int]:
    """TokenReviews and SubjectAccessReviews the API server was asked for, so far (its metrics)."""
    response = api.call_api(*api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"]))
    counted = {"tokenreviews": 0, "subjectaccessreviews": 0}
    for line in response.read().decode().splitlines():
        if (found := REVIEW.match(line)) and 'verb="POST"' in line:
            counted[found[1]] += int(float(found[2]))
    return counted


def test_the_metrics_go_only_to_a_token_allowed_to_get_them(served: Served) -> None:
    assert in_clear(served.port) is None  # nothing in clear, not even a refusal
    refused = {
        "no token": get_metrics(served.port),
        "a junk token": get_metrics(served.port, "junk"),
        "a ServiceAccount's token without the binding": get_metrics(served.port, served.stranger),
    }
    assert {why: answer.status for why, answer in refused.items()} == {
        "no token": 401,
        "a junk token": 401,
        "a ServiceAccount's token without the binding": 403,
    }
    assert not [answer for answer in refused.values() if "multiworld_" in answer.body]
    allowed = get_metrics(served.port, served.reader)
    assert allowed.status == 200, allowed
    assert "multiworld_operator_leader 1.0" in allowed.body.splitlines()


def test_a_tokens_answer_is_remembered_and_junk_costs_a_bounded_number_of_reviews(served: Served) -> None:
    """A scrape every 0.1 s for two seconds costs at most one review of each kind (none where
    the reader's answer is remembered already); 30 junk tokens from one source cost CHECK_BURST
    TokenReviews (and the budget's refill meanwhile), the rest are refused unchecked (429), and
    another source is still answered."""
    before = reviews(served.api)
    for _ in range(20):
        assert get_metrics(served.port, served.reader).status == 200
        time.sleep(0.1)
    scraped = reviews(served.api)
    assert all(scraped[kind] - before[kind] <= 1 for kind in before), (before, scraped)
    answers = [get_metrics(served.port, f"junk-{i}", source="127.0.0.9").status for i in range(30)]
    checked = reviews(served.api)
    assert set(answers) <= {401, 429}, answers
    assert CHECK_BURST <= answers.count(401) < CHECK_BURST + 5, answers
    assert checked["tokenreviews"] - scraped["tokenreviews"] <= answers.count(401) + 1, (scraped, checked)
    assert checked["subjectaccessreviews"] == scraped["subjectaccessreviews"]  # none authenticated
    assert get_metrics(served.port, served.reader, source="127.0.0.10").status == 200


def test_a_real_prometheus_scrapes_with_its_token_as_the_service_monitor_says(served: Served, tmp_path: Path) -> None:
    """Prometheus, given the reader's token in a file and the scheme and TLS settings the
    chart's ServiceMonitor has without the webhook (each replica's own certificate, not
    verified), reads the metrics (its Accept and Accept-Encoding headers, its timeouts)."""
    token = tmp_path / "token"
    token.write_text(served.reader)
    scrape = {"scheme": "https", "authorization": {"credentials_file": str(token)},
              "tls_config": {"insecure_skip_verify": True}}  # fmt: skip
    with Prometheus([f"127.0.0.1:{served.port}"], scrape=scrape) as prometheus:
        (leader,) = prometheus.wait_for("multiworld_operator_leader", lambda result: len(result) == 1, STARTUP_S)
    assert leader["value"][1] == "1"


def threads_and_sockets(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    (threads,) = [int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:")]
    sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:
            pass  # closed meanwhile
    return threads, sockets


def scrape_soon(served: Served) -> float:
    """Seconds until a scrape with the reader's token answered (tried again as it fails), from
    a source that, as Prometheus, opens a connection a scrape (not one the other tests used)."""
    start = time.monotonic()
    while time.monotonic() - start < SCRAPE_WITHIN_S:
        try:
            answer = get_metrics(served.port, served.reader, source=SCRAPER, timeout=SCRAPE_WITHIN_S)
            if answer.status == 200:
                return time.monotonic() - start
        except OSError:
            pass
    return float("inf")


@pytest.mark.parametrize(("sources", "per_source"), [(1, 1000), (100, 8)], ids=["one-source", "many-sources"])
def test_a_connection_flood_holds_a_bounded_number_of_connections_and_a_scrape_still_answers(
    served: Served, sources: int, per_source: int
) -> None:
    pid = served.process.pid
    baseline = threads_and_sockets(pid)
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER, str(served.port), str(sources), str(per_source)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert flooder.stdout is not None and flooder.stdout.readline() == "flooding\n"
    try:
        # The flood at full strength: its first count, a second in.
        tried = int(flooder.stdout.readline())
        held, waits = [threads_and_sockets(pid)], []
        for _ in range(SCRAPES_UNDER_FLOOD):
            waits.append(scrape_soon(served))
            held.append(threads_and_sockets(pid))
        assert flooder.poll() is None, "the flooder stopped"
        tried = int(flooder.stdout.readline())
    finally:
        flooder.kill()
        flooder.wait()
    threads, sockets = max(t for t, _ in held), max(s for _, s in held)
    print(
        f"\nflood of {sources} x {per_source} ({tried} connections tried): threads {baseline[0]} -> "
        f"{threads}, sockets {baseline[1]} -> {sockets}; scrapes after {', '.join(f'{w:.2f}' for w in waits)} s"
    )
    assert threads <= baseline[0] + THREAD_SLACK, (baseline, held)
    # Those held, and those of a turn of accepts closed (a socket goes at the loop's next turn).
    assert sockets <= baseline[1] + MAX_CONNECTIONS + 2 * ACCEPTS_AT_ONCE + SOCKET_SLACK, (baseline, held)
    assert tried > sources * per_source  # it churned: connections closed and tried again
    assert max(waits) < SCRAPE_WITHIN_S, waits
