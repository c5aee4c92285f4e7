"""The runner's end of the local channel: a TCP server speaking `ChannelMessage` lines.

Workers connect to `local://127.0.0.1:PORT` (their MULTIWORLD_TABLE), say `hello` with their
pod name, then send reports and status; the runner pushes each worker its part of every new
world table (the entries of its own worlds: a change elsewhere sends it nothing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pydantic import ValidationError

from multiworld.contract import BrokenWorldReport, ChannelMessage, WorkerStatus, WorldTable

log = logging.getLogger(__name__)


class ChannelServer:
    def __init__(
        self,
        on_report: Callable[[BrokenWorldReport], None],
        on_status: Callable[[WorkerStatus], None],
    ) -> None:
        self._on_report = on_report
        self._on_status = on_status
        self._table = WorldTable()
        self._writers: dict[str, asyncio.StreamWriter] = {}
        # Per pod: the entries last sent to it.
        self._sent: dict[str, WorldTable] = {}
        self._server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1") -> str:
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"local://{host}:{port}"

    def publish(self, table: WorldTable) -> None:
        """Send each connected worker its part of `table` where that part changed (and later
        ones theirs on hello)."""
        if table == self._table:
            return
        self._table = table
        for pod, writer in list(self._writers.items()):
            self._send(pod, writer)

    def _send(self, pod: str, writer: asyncio.StreamWriter) -> None:
        part = self._table.for_pod(pod)
        sent = self._sent.get(pod)
        if sent is not None and sent.worlds == part.worlds:
            return
        try:
            writer.write(ChannelMessage(table=part).encode())
        except (ConnectionError, RuntimeError):
            self._writers.pop(pod, None)
            return
        self._sent[pod] = part

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pod = ""
        try:
            while line := await reader.readline():
                try:
                    msg = ChannelMessage.decode(line)
                except ValidationError as exc:
                    log.warning("bad channel message from %s: %s", pod or "?", exc)
                    continue
                if msg.hello is not None:
                    pod = msg.hello
                    self._writers[pod] = writer
                    self._sent.pop(pod, None)  # a new process of that pod: it knows nothing yet
                    self._send(pod, writer)
                elif msg.report is not None:
                    self._on_report(msg.report)
                elif msg.status is not None:
                    self._on_status(msg.status)
        except ConnectionError:
            pass
        finally:
            if pod and self._writers.get(pod) is writer:
                del self._writers[pod]
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in self._writers.values():
                writer.close()
            self._writers.clear()
            await self._server.wait_closed()
