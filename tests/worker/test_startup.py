"""What needs no communicator: import hygiene, settings from the environment, channel choice,
and the local channel against the runner's real channel server."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from multiworld import DetectConfig
from multiworld.channels import open_channel
from multiworld.channels.local import LocalChannel
from multiworld.channels.none import NoneChannel
from multiworld.contract import BrokenWorldReport, ChannelMessage, WorkerStatus, WorldTable
from multiworld.detect import Verdict, short


def imported_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in ('torch', 'kubernetes', 'kopf') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_import_multiworld_loads_neither_torch_nor_kubernetes() -> None:
    assert imported_after("import multiworld\nfrom multiworld import WorldManager, DetectConfig, ReduceOp") == set()
    assert imported_after("import multiworld.channels.local, multiworld.contract") == set()
    # The kubernetes channel loads kubernetes only when a kubernetes:// table is asked for
    # (here without cluster credentials, so opening it may fail after the import).
    asked = "from multiworld.channels import open_channel\ntry:\n    open_channel('kubernetes://ns/n', 'p')\nexcept Exception:\n    pass"
    assert "kubernetes" in imported_after(asked)
    assert imported_after("from multiworld import World") == {"torch"}


def test_detect_config_from_env() -> None:
    assert DetectConfig.from_env({}) == DetectConfig()
    config = DetectConfig.from_env({"MULTIWORLD_HEARTBEAT_INTERVAL": "0.05", "MULTIWORLD_OP_TIMEOUT": " 30 "})
    assert (config.heartbeat_interval, config.op_timeout, config.dead_after) == (0.05, 30.0, 1.0)
    with pytest.raises(ValueError, match="MULTIWORLD_DEAD_AFTER='soon' is not a number"):
        DetectConfig.from_env({"MULTIWORLD_DEAD_AFTER": "soon"})
    with pytest.raises(ValueError, match="from MULTIWORLD_JOIN_TIMEOUT"):
        DetectConfig.from_env({"MULTIWORLD_JOIN_TIMEOUT": "-1"})
    with pytest.raises(ValueError, match="dead_after"):
        DetectConfig(heartbeat_interval=0.5, dead_after=0.8)


def test_verdict_round_trip_and_foreign_text() -> None:
    verdict = Verdict(reason="rank 2 sent no heartbeat for 1.0s", peer_rank=2, by_rank=0)
    assert Verdict.decode(verdict.encode().encode()) == verdict
    assert verdict.describe() == "rank 2 sent no heartbeat for 1.0s (verdict of rank 0)"
    assert Verdict.decode(b"operator says stop").describe() == "operator says stop"


def test_a_gloo_error_is_told_without_its_source_location_and_hints() -> None:
    text = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:20872. This is typically caused by a remote worker crashing.\nmore")
    assert short(RuntimeError(text)) == "Connection closed by peer [127.0.0.1]:20872."
    assert short(RuntimeError("")) == "RuntimeError"


def test_channel_choice_by_scheme() -> None:
    assert isinstance(open_channel("", "pod"), NoneChannel)
    assert isinstance(open_channel("local://127.0.0.1:5000", "pod"), LocalChannel)
    with pytest.raises(ValueError, match="MULTIWORLD_TABLE='zookeeper://x' has an unknown scheme 'zookeeper'"):
        open_channel("zookeeper://x", "pod")
    with pytest.raises(ValueError, match="is not a channel URL"):
        open_channel("127.0.0.1:5000", "pod")
    for bad in ("local://127.0.0.1", "local://:5000", "local://127.0.0.1:notaport", "local://h:1/path"):
        with pytest.raises(ValueError, match="expected local://HOST:PORT"):
            open_channel(bad, "pod")


def test_local_channel_with_the_runner_server(table_server) -> None:
    tables: list[WorldTable] = []
    arrived = threading.Event()

    def on_table(table: WorldTable) -> None:
        tables.append(table)
        arrived.set()

    first = WorldTable(revision=1)
    table_server.publish(first)
    channel = open_channel(table_server.url, "p0")
    channel.start(on_table)
    assert arrived.wait(30) and tables[-1] == first
    channel.status(WorkerStatus(pod="p0", joined={"w": 1}))
    channel.report(BrokenWorldReport(world="w", epoch=1, reason="rank 1 sent no heartbeat", peer_rank=1, pod="p0"))
    table_server.wait_until(lambda: bool(table_server.reports and table_server.statuses), "report and status")
    assert table_server.statuses[-1].joined == {"w": 1}
    assert table_server.reports[-1].peer_rank == 1
    channel.close()


def test_local_channel_reconnects_and_says_hello_again() -> None:
    """A runner that drops the connection gets a new one, opened with hello and the status."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    channel = LocalChannel("127.0.0.1", port, "p7")
    channel.start(lambda table: None)
    channel.status(WorkerStatus(pod="p7", joined={"w": 2}))
    first, _ = server.accept()
    with first.makefile("rb") as lines:
        assert ChannelMessage.decode(lines.readline()).hello == "p7"
    first.close()
    again, _ = server.accept()
    with again.makefile("rb") as lines:
        assert ChannelMessage.decode(lines.readline()).hello == "p7"
        assert ChannelMessage.decode(lines.readline()).status == WorkerStatus(pod="p7", joined={"w": 2})
    channel.close()
    again.close()
    server.close()


def test_every_op_a_backend_checks_itself_has_a_check_that_names_what_it_refused() -> None:
    from multiworld.backends import GlooDriver, NcclDriver
    from multiworld.ops import ARGUMENT_CHECKS

    for driver in (GlooDriver, NcclDriver):
        assert driver.self_checked <= ARGUMENT_CHECKS.keys(), driver.name
