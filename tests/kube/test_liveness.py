"""The operator's liveness endpoint (kube/liveness.py): 200 while the operator's event loop turns,
500 once it has stalled, whatever asks; served off that loop by the metrics' bounded server, so
junk and floods cost the loop nothing (kopf's endpoint, an aiohttp server on the loop, spent it
on each junk connection: the on-node flood of tests/kube/test_adversary_on_node.py stalled every
recovery). A URL that is not http://HOST:PORT/PATH is refused naming the flag."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from multiworld_operator import cli
from multiworld_operator.kube import liveness as liveness_module
from multiworld_operator.kube.liveness import Liveness
from tests.support.worker_metrics import get

pytestmark = pytest.mark.quick

PATH = "/healthz"


def _probe(port: int) -> tuple[int, bytes]:
    status, _, body = get(port, PATH)
    return status, body


def test_answers_while_the_loop_turns_and_500_once_it_stalls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness_module, "STALL_S", 0.5)
    monkeypatch.setattr(liveness_module, "BEAT_S", 0.05)

    async def scene() -> list[tuple[int, bytes]]:
        liveness = Liveness(f"http://127.0.0.1:0{PATH}")
        port = liveness.start()
        try:
            await asyncio.sleep(0.2)
            answers = [await asyncio.to_thread(_probe, port)]
            # The loop stalls: a probe from another thread meanwhile is told so.
            stalled: list[tuple[int, bytes]] = []

            def probe_later() -> None:
                time.sleep(1.0)
                stalled.append(_probe(port))

            prober = threading.Thread(target=probe_later)
            prober.start()
            time.sleep(1.5)  # blocks the loop
            prober.join()
            answers += stalled
            await asyncio.sleep(0.2)
            answers.append(await asyncio.to_thread(_probe, port))
            elsewhere = await asyncio.to_thread(get, port, "/metrics")
            return [*answers, (elsewhere[0], elsewhere[2])]
        finally:
            await liveness.stop()

    ok, stalled, again, elsewhere = asyncio.run(scene())
    assert ok == (200, b"ok\n")
    assert stalled[0] == 500 and b"has not turned for 1 s" in stalled[1], stalled
    assert again == (200, b"ok\n")
    assert elsewhere[0] == 404


@pytest.mark.parametrize("url", ["0.0.0.0:8080/healthz", "https://0.0.0.0:8080/healthz", "http://0.0.0.0/healthz"])
def test_a_liveness_url_that_is_not_plain_http_with_a_port_is_refused(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        cli.main(["operator", "--liveness", url])
    assert refused.value.code == 2
    assert f"--liveness: {url!r} is not http://HOST:PORT/PATH" in capsys.readouterr().err


def test_the_port_is_free_again_once_stopped() -> None:
    async def scene() -> int:
        liveness = Liveness(f"http://127.0.0.1:0{PATH}")
        port = liveness.start()
        await liveness.stop()
        return port

    port = asyncio.run(scene())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
