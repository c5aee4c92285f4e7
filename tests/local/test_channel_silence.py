"""A worker whose host goes silent is lost to the platform's end of the worker channel within
LOST_AFTER_S, and only such a worker: the silence is made for real on this machine's loopback
(iptables DROP both ways on the worker's connection, as a pulled cable: no FIN, no RST), beside
a worker process frozen by SIGSTOP (its kernel still answers) and one that exits (its kernel
closes the connection). A replaced instance's connection is probed on, unheard, and found lost
too; one whose host acknowledges nothing of the line it is sent on being replaced is found lost
within ANSWER_WITHIN_S."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from multiworld.contract import ChannelMessage, Hello, WorkerStatus
from multiworld_operator.channel_server import ANSWER_WITHIN_S, LOST_AFTER_S, ChannelServer, Speaker

COMMENT = "multiworld-test-silence"
# A worker in a process of its own: hello, then read until the connection ends.
WORKER = """
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.sendall(sys.argv[2].encode())
print("connected", flush=True)
while sock.recv(65536):
    pass
"""


def hello(pod: str) -> bytes:
    return ChannelMessage(hello=Hello(pod=pod)).encode()


@contextmanager
def dropped(port: int) -> Iterator[None]:
    """Every loopback packet from or to local `port` dropped (both ends are this machine's)."""
    rules = [["INPUT", "-i", "lo", "-p", "tcp", flag, str(port)] for flag in ("--sport", "--dport")]
    tag = ["-m", "comment", "--comment", COMMENT, "-j", "DROP"]
    for rule in rules:
        subprocess.run(["iptables", "-w", "-I", *rule, *tag], check=True, capture_output=True)
    try:
        yield
    finally:
        for rule in rules:
            subprocess.run(["iptables", "-w", "-D", *rule, *tag], check=False, capture_output=True)


def test_only_a_worker_whose_host_went_silent_is_lost() -> None:
    assert os.geteuid() == 0, "this test cuts a connection with iptables: run it as root"

    async def run() -> tuple[list[str], float, bool]:
        lost: list[tuple[str, float]] = []
        server = ChannelServer(
            lambda *_: None, lambda *_: None, on_lost=lambda who: lost.append((who.pod, time.monotonic()))
        )
        port = await server.start()
        frozen = subprocess.Popen([sys.executable, "-c", WORKER, str(port), hello("frozen").decode()],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        exiting = subprocess.Popen([sys.executable, "-c", WORKER, str(port), hello("exiting").decode()],
                                   stdout=subprocess.PIPE, text=True)  # fmt: skip
        silent = socket.create_connection(("127.0.0.1", port))
        try:
            silent.sendall(hello("silent"))
            for process in (frozen, exiting):
                assert process.stdout is not None and process.stdout.readline().strip() == "connected"
            await asyncio.sleep(0.5)  # every hello read: each connection is its pod's
            os.kill(frozen.pid, signal.SIGSTOP)
            exiting.kill()
            with dropped(silent.getsockname()[1]):
                cut = time.monotonic()
                deadline = cut + LOST_AFTER_S + 10
                while not lost and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(2)  # anything else lost would be by now
            alive = frozen.poll() is None
            return [pod for pod, _ in lost], (lost[0][1] - cut if lost else float("inf")), alive
        finally:
            silent.close()
            os.kill(frozen.pid, signal.SIGCONT)
            frozen.kill()
            for process in (frozen, exiting):
                process.wait()
            await server.close()

    pods, after, frozen_alive = asyncio.run(run())
    assert pods == ["silent"], pods
    assert LOST_AFTER_S - 1 <= after <= LOST_AFTER_S + 5, f"lost {after:.1f} s after the cut"
    assert frozen_alive


def test_a_speaker_is_lost_only_on_its_current_connection() -> None:
    """A pod that reconnected (a new connection replaced the silent one) is not lost with its old
    connection."""
    assert os.geteuid() == 0, "this test cuts a connection with iptables: run it as root"

    async def run() -> list[Speaker]:
        lost: list[Speaker] = []
        server = ChannelServer(lambda *_: None, lambda *_: None, on_lost=lost.append)
        port = await server.start()
        old, new = socket.create_connection(("127.0.0.1", port)), None
        try:
            old.sendall(hello("pod"))
            await asyncio.sleep(0.5)
            with dropped(old.getsockname()[1]):
                new = socket.create_connection(("127.0.0.1", port))
                new.sendall(hello("pod"))
                await asyncio.sleep(LOST_AFTER_S + 3)
            return lost
        finally:
            old.close()
            if new is not None:
                new.close()
            await server.close()

    assert asyncio.run(run()) == []


def test_a_replaced_instance_is_unheard_but_still_found_lost() -> None:
    """Peers name a silent pod and it is replaced before its connection times out: the channel
    retires that connection (nothing more is read from it or sent to it) and still says it was
    lost, with its instance's uid, so that its node is known."""
    assert os.geteuid() == 0, "this test cuts a connection with iptables: run it as root"

    async def run() -> tuple[list[Speaker], list[str]]:
        lost: list[Speaker] = []
        heard: list[str] = []

        async def as_instance(hello: Hello, source: str) -> Speaker:
            return Speaker("mw", hello.pod, "uid-old")

        server = ChannelServer(
            lambda who, _: heard.append(who.pod), lambda who, _: heard.append(who.pod), as_instance, lost.append
        )
        port = await server.start()
        old = socket.create_connection(("127.0.0.1", port))
        try:
            old.sendall(hello("pod"))
            await asyncio.sleep(0.5)
            server.keep_only("mw", lambda pod, uid: False)  # replaced
            old.sendall(ChannelMessage(status=WorkerStatus(pod="pod")).encode())
            await asyncio.sleep(0.5)
            with dropped(old.getsockname()[1]):
                deadline = time.monotonic() + LOST_AFTER_S + 5
                while not lost and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
            return lost, heard
        finally:
            old.close()
            await server.close()

    lost, heard = asyncio.run(run())
    assert lost == [Speaker("mw", "pod", "uid-old")]
    assert heard == []


def test_a_replaced_instance_whose_host_acknowledges_nothing_is_lost_within_a_second() -> None:
    """Two instances replaced at once, as when their peers name them: one whose host is already
    silent (its packets dropped) is found lost ANSWER_WITHIN_S later, long before its connection
    would time out; one whose process is frozen (its kernel still acknowledges) is not."""
    assert os.geteuid() == 0, "this test cuts a connection with iptables: run it as root"

    async def run() -> tuple[list[tuple[Speaker, float]], bool]:
        lost: list[tuple[Speaker, float]] = []

        async def as_instance(hello: Hello, source: str) -> Speaker:
            return Speaker("mw", hello.pod, f"uid-{hello.pod}")

        server = ChannelServer(
            lambda *_: None, lambda *_: None, as_instance, lambda who: lost.append((who, time.monotonic()))
        )
        port = await server.start()
        frozen = subprocess.Popen([sys.executable, "-c", WORKER, str(port), hello("frozen").decode()],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        silent = socket.create_connection(("127.0.0.1", port))
        try:
            silent.sendall(hello("silent"))
            assert frozen.stdout is not None and frozen.stdout.readline().strip() == "connected"
            await asyncio.sleep(0.5)  # both hellos read
            os.kill(frozen.pid, signal.SIGSTOP)
            with dropped(silent.getsockname()[1]):
                replaced = time.monotonic()
                server.keep_only("mw", lambda pod, uid: False)
                await asyncio.sleep(LOST_AFTER_S - 1)  # before any connection could time out
                answered = frozen.poll() is None
            return [(who, at - replaced) for who, at in lost], answered
        finally:
            silent.close()
            os.kill(frozen.pid, signal.SIGCONT)
            frozen.kill()
            frozen.wait()
            await server.close()

    lost, frozen_alive = asyncio.run(run())
    assert [who for who, _ in lost] == [Speaker("mw", "silent", "uid-silent")], lost
    assert ANSWER_WITHIN_S <= lost[0][1] <= ANSWER_WITHIN_S + 1.0, f"lost {lost[0][1]:.2f} s after it was replaced"
    assert frozen_alive
