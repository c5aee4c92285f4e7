"""A real Prometheus (Debian's /usr/bin/prometheus, installed by `make packages`) for the tests:
it scrapes the given `host:port` targets every second, in a folder of its own, and answers
PromQL through its HTTP API as Grafana would ask it.

    with Prometheus(["127.0.0.1:8000"]) as prometheus:
        prometheus.wait_for("multiworld_operator_leader", lambda result: len(result) == 1)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from multiworld_operator.local.store_ports import free_store_ports

PROMETHEUS = Path("/usr/bin/prometheus")
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 5.0
POLL_S = 0.25
LOG_TAIL_LINES = 30

Result = list[dict[str, Any]]


class PrometheusError(RuntimeError):
    """Prometheus did not start, or refused a query (the message quotes its log or its error)."""


class Prometheus:
    """Use as a context manager: a started and ready Prometheus scraping `targets` (`host:port`,
    path /metrics, job `job`) every `scrape_interval_s`, with `scrape` added to the scrape config
    (e.g. scheme https, authorization, tls_config). Its config, storage and log live in
    `workdir` (kept), or in a temporary folder removed when it stops. Prometheus finds its targets
    about 5 s after it starts (its discovery sends updates at most every 5 s): wait_for them."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        scrape_interval_s: float = 1.0,
        job: str = "multiworld",
        workdir: Path | None = None,
        binary: Path = PROMETHEUS,
        scrape: Mapping[str, Any] | None = None,
    ) -> None:
        if not binary.exists():
            raise FileNotFoundError(
                f"no Prometheus at {binary}: `make packages` installs it (the Debian package `prometheus`)"
            )
        self.targets = list(targets)
        self.scrape_interval_s = scrape_interval_s
        self.job = job
        self.scrape = dict(scrape or {})
        self.binary = binary
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="prometheus-"))
        self.log_path = self.workdir / "prometheus.log"
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Starts it and waits until it says it is ready (/-/ready); stops it again on failure."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self._config()))
        (self.port,) = free_store_ports(1)
        command = [
            str(self.binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stops it (SIGTERM, then SIGKILL after STOP_TIMEOUT_S); idempotent."""
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def query(self, promql: str) -> Result:
        """The result of an instant query now: one dict per series ({"metric": ..., "value": [time,
        "value"]}); a scalar or string result comes as one such dict with no labels. Raises
        PrometheusError with Prometheus's error when it refuses the query."""
        body = self._get("/api/v1/query", {"query": promql})
        data = body["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: Result = data["result"]
        return result

    def wait_for(self, promql: str, predicate: Callable[[Result], bool], timeout: float = 30.0) -> Result:
        """Queries `promql` until `predicate` holds for its result, and returns that result. On
        timeout, TimeoutError names the last result and the targets' scrape health."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                health = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.active_targets()]
                raise TimeoutError(f"{promql!r} after {timeout} s: last result {result}; targets {health}")
            time.sleep(POLL_S)

    def active_targets(self) -> Result:
        """The scrape targets as Prometheus sees them (scrapeUrl, health, lastError, labels...)."""
        targets: Result = self._get("/api/v1/targets", {"state": "active"})["data"]["activeTargets"]
        return targets

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def _config(self) -> dict[str, Any]:
        interval = f"{round(self.scrape_interval_s * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": self.job, "static_configs": [{"targets": self.targets}], **self.scrape}],
        }

    def _wait_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            code = self._process.poll()
            if code is not None:
                raise PrometheusError(f"prometheus exited with {code} before it was ready:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=HTTP_TIMEOUT_S) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass  # not listening yet, or still replaying its storage (503)
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus not ready after {READY_TIMEOUT_S} s:\n{self.log_tail()}")
            time.sleep(POLL_S)

    def _get(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
                body: dict[str, Any] = json.load(response)
        except urllib.error.HTTPError as refused:
            # A refused query is answered 400 or 422 with {"status": "error", "error": ...}.
            text = refused.read().decode(errors="replace")
            try:
                reason = json.loads(text)["error"]
            except (ValueError, KeyError):
                reason = text
            raise PrometheusError(f"{path} {params} refused ({refused.code}): {reason}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body}")
        return body
