"""The operator under attack (issue 32): its peak RSS, and how soon an unrelated MultiWorld's
failed pod is replaced, with no attack (the baseline) and under each attack.

A control plane, the chart, `multiworld operator` as the chart's ServiceAccount and a stand-in
kubelet (tests/support/operator_scene.py); "other", a star of --worlds worlds, is failed --failures
times per phase (react: its pod marked Failed -> the replacement exists at the new epoch), while
a tenant's MultiWorld "mine" of two worlds is the attacker's own. The phases, in this order:
  baseline      no attack
  channel_junk  --attackers raw-socket clients on the operator's worker channel, as fast as
                they can: hellos with junk tokens (a TokenReview each, until the per-source
                budget refuses them unchecked) and lines past the longest message
  port_flood    --attackers processes of raw-socket clients on every port the operator serves
                (the worker channel, the metrics over TLS, the liveness endpoint), from 64
                addresses, as fast as they can: connections that send nothing, binary, a 300 KB
                line or plain HTTP and close (each TLS one a failed handshake)
  memory        the tenant's memory ConfigMap of "mine" holding gzip of 30 MiB of JSON objects
                (30 KiB), and the operator restarted onto it (it reads every memory at start)
The operator's peak RSS is the kernel's high-water mark (VmHWM) of its process at the end of
each phase: the first three phases share a process, the memory phase has its own.
"""

from __future__ import annotations

import base64
import gzip
import multiprocessing
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from multiworld.contract import ChannelMessage, Hello
from multiworld_operator.channel_server import MAX_LINE
from multiworld_operator.kube.memory.planner_memory import MEMORY_KEY
from multiworld_operator.kube.workers.channel_settings import DEFAULT_PORT
from tests.support import bench_common as common, limits_support as limits
from tests.support.operator_scene import Scene, fail_and_recover, scene, start, wait_for
from tests.support.worker_metrics import junk_flood

PHASES = ("baseline", "channel_junk", "port_flood", "memory")
# The other MultiWorld's failures may take this many times their baseline under an attack.
REACT_FACTOR = 3.0


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.setting("--worlds", int, 8, 2, "worlds of the unrelated MultiWorld")
    p.setting("--failures", int, 5, 2, "failures of the unrelated MultiWorld per phase")
    p.setting("--attackers", int, 8, 2, "raw-socket clients of the channel attack")
    common.credentials_flag(p)
    return p.parse_args(argv)


def junk_client(port: int, stop: threading.Event, sent: list[int]) -> None:
    """Until `stop`: a connection, a hello with a junk token or a line past MAX_LINE, the answer
    read; again."""
    hello = ChannelMessage(hello=Hello(pod="mine-a-0", token="junk" * 256)).encode()
    too_long = b"{" + b" " * MAX_LINE + b"}\n"
    while not stop.is_set():
        for payload in (hello, hello, too_long):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                    sock.sendall(payload)
                    sock.recv(4096)
            except OSError:
                pass
            sent[0] += 1


@contextmanager
def channel_junk(attackers: int) -> Iterator[list[int]]:
    stop, sent = threading.Event(), [0]
    threads = [
        threading.Thread(target=junk_client, args=(DEFAULT_PORT, stop, sent), daemon=True) for _ in range(attackers)
    ]
    for thread in threads:
        thread.start()
    try:
        yield sent
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)


def flooder(ports: list[int], sources: list[str], stop: Any, made: Any) -> None:
    """One attacker process of the port flood: its count of connections added to `made`."""
    count = junk_flood(ports, sources, stop)
    with made.get_lock():
        made.value += count


@contextmanager
def port_flood(ports: list[int], attackers: int) -> Iterator[Any]:
    """`attackers` processes of junk connections to `ports` (worker_metrics.junk_flood), each a
    process of its own as a hostile pod is: threads of this process would fight over its GIL with
    the stand-in kubelet's watch, whose clock the react figure is read on, and time this process
    rather than the operator. Yields the connections made (`.value`), counted once the flood
    stops."""
    spawn = multiprocessing.get_context("spawn")
    stop, made = spawn.Event(), spawn.Value("q", 0)
    sources = [f"127.0.5.{i}" for i in range(1, 65)]
    processes = [
        spawn.Process(target=flooder, args=(ports, sources, stop, made), daemon=True) for _ in range(attackers)
    ]
    for process in processes:
        process.start()
    try:
        yield made
    finally:
        stop.set()
        for process in processes:
            process.join(10)
            process.kill()


def spoil_memory(s: Scene) -> None:
    """The tenant writes gzip of 30 MiB of JSON objects in its memory; the operator restarts."""
    packed = gzip.compress(b"[" + b"{}," * 10_000_000 + b"{}]", compresslevel=9)
    s.kube.core.patch_namespaced_config_map(
        "mine", s.kube.namespace, {"binaryData": {MEMORY_KEY: base64.b64encode(packed).decode()}}
    )
    s.operator.restart()
    wait_for("mine's memory rebuilt", lambda: "MemoryRebuilt" in s.kube.event_reasons("mine"))


def failures(s: Scene, count: int, worlds: int, first: int) -> list[float]:
    return [fail_and_recover(s, "other", (first + i) % worlds) for i in range(count)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    react: dict[str, list[float]] = {}
    rss: dict[str, float] = {}
    junk_sent = flooded = 0
    with (
        tempfile.TemporaryDirectory(prefix="bench-attacks-") as folder,
        scene(Path(folder), args.credentials, endpoints=True) as s,
    ):
        start(s, "mine", 2)
        start(s, "other", args.worlds)
        react["baseline"] = failures(s, args.failures, args.worlds, 0)
        rss["baseline"] = s.operator.peak_rss_mib()
        with channel_junk(args.attackers) as sent:
            time.sleep(2)  # the attack under way before the first failure
            react["channel_junk"] = failures(s, args.failures, args.worlds, args.failures)
            junk_sent = sent[0]
        rss["channel_junk"] = s.operator.peak_rss_mib()
        with port_flood([DEFAULT_PORT, s.metrics_port, s.liveness_port], args.attackers) as made:
            time.sleep(2)
            react["port_flood"] = failures(s, args.failures, args.worlds, 2 * args.failures)
        flooded = made.value
        rss["port_flood"] = s.operator.peak_rss_mib()
        spoil_memory(s)
        react["memory"] = failures(s, args.failures, args.worlds, 3 * args.failures)
        rss["memory"] = s.operator.peak_rss_mib()
        loaded = s.loaded
    chart_mib = limits.chart_memory_limit_mib()
    base = statistics.median(react["baseline"])
    rows = [
        [phase, common.fmt_s(statistics.median(react[phase])), common.fmt_s(max(react[phase])), f"{rss[phase]:.0f}"]
        for phase in PHASES
    ]
    body = [
        f"'other': {args.worlds} worlds, {args.failures} failures a phase; the channel attack made {junk_sent} "
        f"connections from {args.attackers} clients, the port flood {flooded}",
        common.table(["phase", "react median", "react max", "operator peak RSS MiB"], rows),
    ]
    targets = [
        *(
            common.Target(f"{phase}: operator peak RSS (the chart's limit)", rss[phase], chart_mib, " MiB")
            for phase in PHASES
        ),
        *(
            common.Target(
                f"{phase}: react median (3x the baseline)", statistics.median(react[phase]), REACT_FACTOR * base, " s"
            )
            for phase in PHASES[1:]
        ),
    ]
    common.report("the operator under attack", loaded, body, targets)
    if args.json:
        common.json_line(
            {
                "bench": "attacks",
                "react_s": react,
                "operator_rss_mib": rss,
                "junk_connections": junk_sent,
                "flood_connections": flooded,
            }
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
