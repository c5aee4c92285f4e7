"""Starting a worker: import hygiene, settings from the environment, channel choice, the local
channel against the runner's real channel server, and warm spares (real processes over gloo)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from multiworld import DetectConfig
from multiworld.channels import open_channel
from multiworld.channels.none import NoneChannel
from multiworld.channels.stream import StreamChannel
from multiworld.contract import (
    BrokenWorldReport,
    ChannelMessage,
    Hello,
    WorkerEnv,
    WorkerStatus,
    WorldEntry,
    WorldTable,
)
from multiworld.detect.verdicts import Verdict
from multiworld.errors import says_unsupported, short
from tests.support.worker_support import TEST_DETECT, Member, TableServer, assignment, free_ports


def imported_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in ('torch', 'kubernetes', 'kopf') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_import_multiworld_loads_neither_torch_nor_kubernetes() -> None:
    assert imported_after("import multiworld\nfrom multiworld import WorldManager, DetectConfig, ReduceOp") == set()
    # The operator's channel is plain TCP: the worker never loads kubernetes.
    opened = "from multiworld.channels import open_channel\nopen_channel('operator://127.0.0.1:9', 'p')"
    assert imported_after(opened) == set()
    assert imported_after("from multiworld import World") == {"torch"}


def test_importing_the_library_changes_nothing_in_the_process() -> None:
    """What the operator and the planner import (the contract) loads no runtime module, and no
    import replaces sys.exit or sys.excepthook or registers an exit handler: the first
    WorldManager does."""
    probe = (
        "import atexit, logging, sys\n"  # logging registers an exit handler of its own
        "hooks = (sys.exit, sys.excepthook, atexit._ncallbacks())\n"
        "import multiworld.contract\n"
        "runtime = sorted(m for m in sys.modules if m.startswith('multiworld.') and m not in {light})\n"
        "import multiworld\n"
        "from multiworld import WorldManager, init_from_env, Work\n"
        "unchanged = (sys.exit, sys.excepthook, atexit._ncallbacks()) == hooks\n"
        "WorldManager(pod='p').close()\n"
        "print(runtime, unchanged, sys.excepthook is hooks[1], atexit._ncallbacks() > hooks[2])"
    ).format(
        light=repr(
            {
                "multiworld.contract",
                "multiworld.detect",
                "multiworld.detect.config",
                "multiworld.errors",
                "multiworld.world",
                "multiworld.world.reduce_op",
            }
        )
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "True", "False", "True"], out


def test_detect_config_from_env() -> None:
    assert DetectConfig.from_env({}) == DetectConfig()
    config = DetectConfig.from_env({"MULTIWORLD_HEARTBEAT_INTERVAL": "0.05", "MULTIWORLD_OP_TIMEOUT": " 30 "})
    assert (config.heartbeat_interval, config.op_timeout, config.dead_after) == (0.05, 30.0, 0.4)
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
    text = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:20872. This is typically caused by a remote worker crashing.\nmore"
    )
    assert short(RuntimeError(text)) == "Connection closed by peer [127.0.0.1]:20872."
    assert short(RuntimeError("")) == "RuntimeError"


def test_a_backend_lacking_an_op_is_told_apart_from_a_failure() -> None:
    # Refusals as torch's backends word them (torch 2.11's gloo lacks all_to_all); they become
    # UnsupportedOpError, and a lost peer or a bad argument does not.
    for text in (
        "Backend gloo does not support alltoall",
        "ProcessGroupGloo does not support reduce_scatter",
        "Unsupported reduce operation",
        "allgather_into_tensor_coalesced is not supported",
        "not implemented for this backend",
    ):
        assert says_unsupported(text), text
    for text in ("Connection closed by peer [127.0.0.1]:20872", "Timed out waiting 1800000ms", "Invalid tensor size"):
        assert not says_unsupported(text), text


def test_channel_choice_by_scheme() -> None:
    assert isinstance(open_channel("", "pod"), NoneChannel)
    assert isinstance(open_channel("local://127.0.0.1:5000", "pod"), StreamChannel)
    assert isinstance(open_channel("operator://operator.ns.svc:7443", "pod"), StreamChannel)
    with pytest.raises(ValueError, match="MULTIWORLD_TABLE='zookeeper://x' has an unknown scheme 'zookeeper'"):
        open_channel("zookeeper://x", "pod")
    with pytest.raises(ValueError, match="is not a channel URL"):
        open_channel("127.0.0.1:5000", "pod")
    for bad in ("local://127.0.0.1", "local://:5000", "local://127.0.0.1:notaport", "operator://h:1/path"):
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


def test_channel_reconnects_and_says_hello_again_with_the_token_as_it_is_now(tmp_path: Path) -> None:
    """A platform that drops the connection gets a new one, opened with hello (the token read
    afresh: the kubelet rotates it), the status and the report it may have lost."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("first\n")
    channel = StreamChannel("127.0.0.1", port, "p7", token)
    channel.start(lambda table: None)
    channel.status(WorkerStatus(pod="p7", joined={"w": 2}))
    report = BrokenWorldReport(world="w", epoch=2, reason="recv timed out", pod="p7")
    first, _ = server.accept()
    first.settimeout(30)
    with first.makefile("rb") as lines:
        assert ChannelMessage.decode(lines.readline()).hello == Hello(pod="p7", token="first")
        channel.report(report)
        # The status (in the greeting, or as queued, or both), then the report.
        sent = [ChannelMessage.decode(lines.readline())]
        while sent[-1].report is None:
            sent.append(ChannelMessage.decode(lines.readline()))
        assert all(m.status == WorkerStatus(pod="p7", joined={"w": 2}) for m in sent[:-1])
        assert sent[-1].report == report
    token.write_text("rotated")
    first.close()
    again, _ = server.accept()
    with again.makefile("rb") as lines:
        assert ChannelMessage.decode(lines.readline()).hello == Hello(pod="p7", token="rotated")
        assert ChannelMessage.decode(lines.readline()).status == WorkerStatus(pod="p7", joined={"w": 2})
        assert ChannelMessage.decode(lines.readline()).report == report
    channel.close()
    again.close()
    server.close()


def test_a_refused_channel_says_why_and_tries_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    channel = StreamChannel("127.0.0.1", server.getsockname()[1], "p7", tmp_path / "missing-token")
    channel.start(lambda table: None)
    first, _ = server.accept()
    with first.makefile("rb") as lines:
        assert ChannelMessage.decode(lines.readline()).hello == Hello(pod="p7")
    first.sendall(ChannelMessage(refused="the token is not valid").encode())
    first.close()
    again, _ = server.accept()
    again.close()
    channel.close()
    server.close()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "cannot read this pod's token" in said and "refused this pod: the token is not valid" in said


def test_every_op_a_backend_checks_itself_has_a_check_that_names_what_it_refused() -> None:
    from multiworld.world.backends import GlooDriver, NcclDriver
    from multiworld.world.ops import ARGUMENT_CHECKS

    for driver in (GlooDriver, NcclDriver):
        assert driver.self_checked <= ARGUMENT_CHECKS.keys(), driver.name


# ---- warm spares ---------------------------------------------------------------------------

SPARE = "mw-replica-spare-b"
PLAYED = "mw-replica-0"
PEER = "mw-replica-1"
DETECT_ENV = {f"MULTIWORLD_{name.upper()}": str(seconds) for name, seconds in TEST_DETECT.items()}

# A member's program: nothing of torch before init_from_env, which a spare blocks in. A thread
# tells when torch is loaded; `exit-on-sigterm` installs a SIGTERM handler, as many programs do.
PROGRAM = """
import json, signal, sys, threading, time

def emit(event, **fields):
    print(json.dumps({"event": event, **fields}), flush=True)

def watch_torch():
    while "torch" not in sys.modules:
        time.sleep(0.01)
    emit("torch_loaded")

if sys.argv[1:] == ["exit-on-sigterm"]:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
threading.Thread(target=watch_torch, daemon=True).start()
import multiworld as mw
manager = mw.init_from_env()
emit("initialized", plays=manager.plays, status=manager.status().model_dump(mode="json"))
import torch
world = manager.world("w")
value = torch.full((1,), float(world.rank + 1))
world.all_reduce(value)
emit("reduced", value=value.tolist())
sys.stdin.readline()
manager.close()
"""


def spare_env(server: TableServer, pod: str) -> dict[str, str]:
    return {**WorkerEnv(pod=pod, table=server.url, spare="replica").to_env(), **DETECT_ENV}


def start_program(spawn: Callable[..., Member], pod: str, env: dict[str, str], *flags: str) -> Member:
    return spawn(pod, {}, env, ["-c", PROGRAM, *flags])


def statuses_of(server: TableServer, pod: str) -> list[WorkerStatus]:
    return [s for s in server.statuses if s.pod == pod]


def test_a_spare_waits_for_an_identity_then_plays_its_member(spawn, table_server) -> None:
    port = free_ports(1)[0]
    spare = start_program(spawn, SPARE, spare_env(table_server, SPARE))
    peer_env = {**table_server.env(PEER, [assignment("w", 1, 2, port)]), **DETECT_ENV}
    peer = start_program(spawn, PEER, peer_env)

    table_server.wait_until(lambda: any(s.waiting for s in statuses_of(table_server, SPARE)), "the spare waits")
    spare.wait_for("torch_loaded", timeout=10)  # loaded by init_from_env before the spare said it waits
    time.sleep(1.0)  # time enough for an init_from_env that did not block to return
    assert spare.proc.poll() is None and not spare.named("initialized"), spare.stderr()
    assert all(s.waiting and not s.joined and not s.plays for s in statuses_of(table_server, SPARE))

    entry = WorldEntry(name="w", epoch=1, host="127.0.0.1", port=port, pods=[SPARE, PEER], plays={SPARE: PLAYED})
    table_server.publish(WorldTable(revision=1, worlds=[entry]))

    initialized = spare.wait_for("initialized")
    assert initialized["plays"] == PLAYED
    # init_from_env returned with the world its identity brought already joined.
    assert initialized["status"]["joined"] == {"w": 1}
    assert (initialized["status"]["waiting"], initialized["status"]["plays"]) == (False, PLAYED)
    assert peer.wait_for("initialized")["plays"] == PEER
    for member in (spare, peer):
        assert member.wait_for("reduced")["value"] == [3.0]

    def spare_plays() -> bool:
        latest = statuses_of(table_server, SPARE)[-1]
        return (latest.waiting, latest.plays, latest.joined) == (False, PLAYED, {"w": 1})

    table_server.wait_until(spare_plays, "the spare's status says whom it plays")
    assert statuses_of(table_server, PEER)[-1].plays == ""
    for member in (spare, peer):
        member.tell("stop")
        assert member.wait_exit() == 0, member.stderr()


# How each signal ends a spare waiting for an identity, per the program's handling of it.
SIGNALLED: dict[str, tuple[signal.Signals, tuple[str, ...], int]] = {
    "spare-sigterm": (signal.SIGTERM, (), -signal.SIGTERM),
    "spare-sigterm-handled": (signal.SIGTERM, ("exit-on-sigterm",), 143),
    "spare-sigint": (signal.SIGINT, (), -signal.SIGINT),  # KeyboardInterrupt, then SIGINT's own end
}


def test_a_spare_without_an_identity_ends_promptly_on_a_signal(spawn, table_server) -> None:
    spares = {
        pod: start_program(spawn, pod, spare_env(table_server, pod), *flags) for pod, (_, flags, _) in SIGNALLED.items()
    }
    for pod in spares:
        table_server.wait_until(lambda pod=pod: any(s.waiting for s in statuses_of(table_server, pod)), f"{pod} waits")
    for pod, member in spares.items():
        sig, _, status = SIGNALLED[pod]
        started = time.monotonic()
        member.signal(sig)
        returncode = member.wait_exit(timeout=10)
        took = time.monotonic() - started
        assert returncode == status, f"{pod} ended with {returncode}:\n{member.stderr()}"
        assert took < 5.0, f"{pod} took {took:.1f}s to end"
        assert not member.named("initialized")


def test_a_spare_env_has_no_start_up_worlds_and_a_live_table() -> None:
    table = "local://127.0.0.1:5000"
    spare = WorkerEnv(pod=SPARE, table=table, spare="replica")
    assert WorkerEnv.from_env(spare.to_env()) == spare
    world = assignment("w", 0, 2, 5001)
    for env in (WorkerEnv(pod=SPARE, worlds=[world], table=table).to_env(), WorkerEnv(pod=SPARE).to_env()):
        with pytest.raises(ValueError, match="MULTIWORLD_SPARE"):
            WorkerEnv.from_env({**env, "MULTIWORLD_SPARE": "replica"})
