"""The liveness endpoint (`multiworld operator --liveness URL`): GET on the URL's path answers
200 while the operator's event loop turns, 500 once it has not turned for STALL_S.

kopf's own endpoint is an aiohttp server on the operator's event loop, with no bound on the
connections anything in the cluster may open nor on what they send: a pod flooding it with
junk held that loop (and wrote a traceback with the junk in the log for each connection), and
every MultiWorld's recovery waited. This one is the metrics' bounded server (metrics/server.py),
plain HTTP, on a loop and thread of its own; it reads one number the operator's loop writes each
BEAT_S, so a flood of probes costs that loop nothing and a stuck loop is still seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from urllib.parse import urlsplit

from multiworld_operator.kube.metrics.server import MetricsServer

BEAT_S = 1.0
# A loop that has not turned for this long is stuck: the kubelet restarts the operator after
# the chart's failureThreshold such answers in a row.
STALL_S = 10.0


class Liveness:
    """Beats on the running loop from `start` and serves the beats' age at `url`."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.port is None:
            raise ValueError(f"--liveness: {url!r} is not http://HOST:PORT/PATH")
        self.host, self.port, self.path = parts.hostname or "0.0.0.0", parts.port, parts.path or "/"
        self._beat = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._server = MetricsServer(self._answer, None, fresh_s=0, path=self.path, what="liveness")

    def start(self) -> int:
        """Beat on the running loop and serve; the port served on (0 in the URL: a free one).
        Once only: kopf runs the startup handler again after a later step of it failed."""
        if self._task is not None:
            return self._server.port
        self._beat = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._beating())
        return self._server.start(self.host, self.port)

    async def stop(self) -> None:
        self._server.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _beating(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(BEAT_S)

    def _answer(self) -> bytes:
        """Runs on the server's thread: reads the last beat only."""
        quiet = time.monotonic() - self._beat
        if quiet > STALL_S:
            raise RuntimeError(f"the operator's event loop has not turned for {quiet:.0f} s")
        return b"ok\n"
