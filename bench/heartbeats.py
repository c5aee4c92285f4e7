"""What failure detection costs as worlds grow in ranks and in number, and how fast a frozen
process is seen in every world it shares.

1. Requests per heartbeat interval for one world of N ranks (--ranks, default 4 and 16): N
   WorldManagers in one member process, each with its own failure detector as separate
   processes would have, all in one world. Once it has formed and ticked for 1 s, each
   detector's own count of the requests it sent (WorldManager.heartbeat_load: calls, and the
   keys they read or wrote) is read twice; the clock starts at the first reading and stops at
   the second (--window-s apart). Per interval = the sum over the N detectors / (window /
   heartbeat_interval): the requests the world's store serves (epoch checks, verdicts) and those
   its host's beat store serves (heartbeats).
2. Two processes sharing K worlds of 2 ranks (--worlds, default 1, 20 and 200): "host" is rank
   0 of every world (it serves their stores), "member" rank 1. Once both have joined all K
   worlds and settled for 2 s: the idle CPU of each process in % of one core over --idle-s
   (user + system time from /proc/<pid>/stat, the clock starting and stopping at the two
   readings), its native threads (/proc/<pid>/status Threads) and RSS (VmRSS) at the end of that
   window; per world: (value at K - value at 1) / (K - 1). Then one process is SIGSTOPped:
   the clock starts just before os.kill in this coordinating process and stops at the wall
   time at which the other process saw the last of its K worlds broken (it polls world.broken
   every 2 ms from just before the signal; one machine, one clock). "peer frozen": the member
   is stopped and the host judges its heartbeat; "host frozen": the host is stopped and the
   member's calls to it stall. Each trial forms its pair of processes afresh.

Idle CPU on a machine that other work shares is noisy: the load average is printed.
Detection settings come from the MULTIWORLD_* environment (defaults as shipped).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tests.support import bench_common as common
from tests.support.cpu_load import cpu_seconds

SETTLE_S = 2.0
POLL_S = 0.002
JOIN_ATTEMPTS = 3
DETECT_WAIT_S = 60.0
CPU_LIMIT_PCT = 5.0
AS_FAST_AS = 1.5
# Linear growth: keys per interval may grow with the ranks, with some slack for the host's
# own keys; quadratic growth (every member reading every peer) is far above.
LINEAR_SLACK = 1.25
FROZEN = ("peer_frozen", "host_frozen")


def sizes(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"sizes must be > 0, got {text}")
    return sorted(set(values))


def parse_args(argv: Sequence[str] | None) -> Any:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument(
        "--ranks",
        type=sizes,
        default=None,
        help="world sizes whose requests are counted, comma-separated; empty: none (default 4,16; 2,4 with --quick)",
    )
    p.add_argument(
        "--worlds",
        type=sizes,
        default=None,
        help="numbers of worlds two processes share, comma-separated; empty: none (default 1,20,200; 1,3 with --quick)",
    )
    p.add_argument("--trials", type=common.positive(int), default=1, help="pairs of processes per size and frozen side")
    p.setting("--idle-s", float, 10.0, 2.0, "idle CPU window")
    p.setting("--window-s", float, 5.0, 1.0, "request counting window")
    p.add_argument("--member", choices=["counter", "pair"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ranks = args.ranks if args.ranks is not None else ([2, 4] if args.quick else [4, 16])
    args.worlds = args.worlds if args.worlds is not None else ([1, 3] if args.quick else [1, 20, 200])
    return args


# ---- the member side -------------------------------------------------------------------------


def assignment(name: str, rank: int, size: int, port: int) -> Any:
    import multiworld as mw

    return mw.WorldAssignment(name=name, rank=rank, size=size, host="127.0.0.1", port=port)


def counter() -> None:
    """N managers in one world; their detectors' counts over a window."""
    import torch

    import multiworld as mw

    torch.set_num_threads(1)
    for command in common.commands():
        ranks, port, window = command["ranks"], command["port"], command["window_s"]
        config = mw.DetectConfig.from_env()
        managers = [mw.WorldManager(pod=f"m{rank}", config=config) for rank in range(ranks)]
        joins = [
            threading.Thread(target=m.join, args=(assignment("w", r, ranks, port),)) for r, m in enumerate(managers)
        ]
        for join in joins:
            join.start()
        for join in joins:
            join.join()
        time.sleep(1.0)
        before = [m.heartbeat_load() for m in managers]
        time.sleep(window)
        after = [m.heartbeat_load() for m in managers]
        intervals = window / config.heartbeat_interval
        figures = {
            store: {
                what: sum(
                    getattr(getattr(a, store), what) - getattr(getattr(b, store), what)
                    for a, b in zip(after, before, strict=True)
                )
                / intervals
                for what in ("calls", "keys")
            }
            for store in ("world_stores", "beat_stores")
        }
        common.emit("counted", ranks=ranks, figures=figures)
        for manager in managers:
            manager.close()


def pair() -> None:
    """One process of a pair: joins K worlds as told, then waits; once armed, reports when
    every world has broken."""
    import logging

    import torch

    import multiworld as mw

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)  # a join that fails says why on stderr
    manager = mw.WorldManager(pod=f"pair-{os.getpid()}", config=mw.DetectConfig.from_env())
    common.emit("ready")
    worlds: dict[str, Any] = {}
    for command in common.commands():
        if command["cmd"] == "join":
            started = time.time()
            assignments = [assignment(f"w{i}", command["rank"], 2, port) for i, port in enumerate(command["ports"])]
            worlds = manager.join_all(assignments)
            common.emit("joined", worlds=len(worlds), seconds=time.time() - started)
        elif command["cmd"] == "arm":
            threading.Thread(target=watch_breaks, args=(list(worlds.values()),), daemon=True).start()
            common.emit("armed")
        else:
            os._exit(0)  # the peer may be frozen: no goodbye


def watch_breaks(worlds: list[Any]) -> None:
    while not all(w.broken for w in worlds):
        time.sleep(POLL_S)
    common.emit("all_broken", reasons=sorted({w.error.reason.split(" for ")[0] for w in worlds}))


# ---- the coordinator -------------------------------------------------------------------------


@dataclass(frozen=True)
class Idle:
    cpu_pct: float
    threads: int
    rss_mib: float


@dataclass(frozen=True)
class PairTrial:
    worlds: int
    frozen: str
    idle: dict[str, Idle]
    detect_s: float
    reasons: list[str]


def measure_idle(members: dict[str, common.Member], idle_s: float) -> dict[str, Idle]:
    start = {role: cpu_seconds(m.pid) for role, m in members.items()}
    began = time.monotonic()
    time.sleep(idle_s)
    took = time.monotonic() - began
    return {
        role: Idle(
            cpu_pct=100 * (cpu_seconds(m.pid) - start[role]) / took,
            threads=common.status_field(m.pid, "Threads"),
            rss_mib=common.status_field(m.pid, "VmRSS") / 1024,
        )
        for role, m in members.items()
    }


class JoinsFailed(RuntimeError):
    pass


def run_pair(script: list[str], worlds: int, frozen: str, idle_s: float) -> PairTrial:
    """One trial; a pair whose joins fail (on a busy machine a store's client can wait out its
    timeout on a name lookup) is formed again, up to JOIN_ATTEMPTS times."""
    for attempt in range(1, JOIN_ATTEMPTS + 1):
        try:
            return pair_trial(script, worlds, frozen, idle_s)
        except JoinsFailed as exc:
            if attempt == JOIN_ATTEMPTS:
                raise
            print(f"attempt {attempt}: {str(exc).splitlines()[0]}", file=sys.stderr)
    raise AssertionError("unreachable")


def pair_trial(script: list[str], worlds: int, frozen: str, idle_s: float) -> PairTrial:
    ports = common.free_ports(worlds)
    with common.Members(script) as started:
        members = {role: started.start(role, ["--member", "pair"]) for role in ("host", "member")}
        for member in members.values():
            member.wait_for("ready")
        for rank, member in enumerate(members.values()):
            member.tell({"cmd": "join", "rank": rank, "ports": ports})
        for member in members.values():
            joined = member.wait_for("joined", timeout=common.MEMBER_WAIT_S + worlds)
            if joined["worlds"] != worlds:
                raise JoinsFailed(f"{member.name} joined {joined['worlds']} of {worlds} worlds:\n{member.stderr()}")
        time.sleep(SETTLE_S)
        idle = measure_idle(members, idle_s)
        victim, judge = (
            (members["member"], members["host"]) if frozen == "peer_frozen" else (members["host"], members["member"])
        )
        judge.tell({"cmd": "arm"})
        judge.wait_for("armed")
        signalled = time.time()
        victim.signal(signal.SIGSTOP)
        seen = judge.wait_for("all_broken", timeout=DETECT_WAIT_S)
    return PairTrial(worlds, frozen, idle, seen["at"] - signalled, seen["reasons"])


def count_requests(script: list[str], ranks: list[int], window_s: float) -> dict[int, dict[str, dict[str, float]]]:
    counted: dict[int, dict[str, dict[str, float]]] = {}
    with common.Members(script) as started:
        member = started.start("counter", ["--member", "counter"])
        for size in ranks:
            (port,) = common.free_ports(1)
            member.tell({"ranks": size, "port": port, "window_s": window_s})
            counted[size] = member.wait_for("counted", ranks=size, timeout=common.MEMBER_WAIT_S + window_s)["figures"]
    return counted


def coordinate(args: Any) -> int:
    load = common.machine_load()
    script = common.program(__file__)
    requests = count_requests(script, args.ranks, args.window_s) if args.ranks else {}
    trials = [
        run_pair(script, k, frozen, args.idle_s) for k in args.worlds for frozen in FROZEN for _ in range(args.trials)
    ]
    present(args, load, requests, trials)
    return 0


def median_idle(trials: list[PairTrial], role: str) -> Idle:
    return Idle(
        cpu_pct=statistics.median(t.idle[role].cpu_pct for t in trials),
        threads=round(statistics.median(t.idle[role].threads for t in trials)),
        rss_mib=statistics.median(t.idle[role].rss_mib for t in trials),
    )


def present(args: Any, load: str, requests: dict[int, dict[str, dict[str, float]]], trials: list[PairTrial]) -> None:
    body: list[str] = []
    targets: list[common.Target] = []
    results: dict[str, Any] = {}
    if requests:
        rows = [
            [
                str(n),
                f"{f['beat_stores']['calls']:.1f}",
                f"{f['beat_stores']['keys']:.1f}",
                f"{f['world_stores']['calls']:.2f}",
                f"{f['world_stores']['keys']:.2f}",
            ]
            for n, f in requests.items()
        ]
        body.append(
            "requests per heartbeat interval, one world (summed over its members)\n"
            + common.table(
                ["ranks", "beat store calls", "beat store keys", "world store calls", "world store keys"], rows
            )
        )
        results["requests_per_interval"] = {
            str(n): {"beat_store": f["beat_stores"], "world_store": f["world_stores"]} for n, f in requests.items()
        }
        low, high = min(requests), max(requests)
        if high > low:
            high_keys = sum(requests[high][s]["keys"] for s in requests[high])
            grown = high_keys / sum(requests[low][s]["keys"] for s in requests[low])
            targets.append(
                common.Target(f"keys per interval, {high} ranks / {low} ranks", grown, high / low * LINEAR_SLACK)
            )
    if trials:
        by_k = {k: [t for t in trials if t.worlds == k] for k in args.worlds}
        idle = {k: {role: median_idle(ts, role) for role in ("host", "member")} for k, ts in by_k.items()}
        detect = {
            k: {f: statistics.median(t.detect_s for t in ts if t.frozen == f) for f in FROZEN} for k, ts in by_k.items()
        }
        rows = []
        for k in args.worlds:
            for role in ("host", "member"):
                i = idle[k][role]
                rows.append(
                    [
                        str(k),
                        role,
                        f"{i.cpu_pct:.1f}",
                        str(i.threads),
                        f"{i.rss_mib:.0f}",
                        common.fmt_s(detect[k]["peer_frozen" if role == "host" else "host_frozen"]),
                    ]
                )
        body.append(
            "two processes sharing K worlds of 2 ranks (host: rank 0 of each)\n"
            + common.table(
                ["K", "process", "idle CPU %", "threads", "RSS MiB", "saw the other frozen in all K after"], rows
            )
        )
        reasons = sorted({r for t in trials for r in t.reasons})
        body.append("reasons seen: " + "; ".join(reasons))
        results["shared_worlds"] = {
            str(k): {
                "idle_cpu_pct": {role: idle[k][role].cpu_pct for role in idle[k]},
                "threads": {role: idle[k][role].threads for role in idle[k]},
                "rss_mib": {role: idle[k][role].rss_mib for role in idle[k]},
                "detect_s": detect[k],
            }
            for k in args.worlds
        }
        one, most = min(args.worlds), max(args.worlds)
        if most > one:
            per_world = {
                what: {
                    role: (getattr(idle[most][role], what) - getattr(idle[one][role], what)) / (most - one)
                    for role in ("host", "member")
                }
                for what in ("threads", "rss_mib")
            }
            body.append(
                common.table(
                    ["per world", "host", "member"],
                    [
                        [
                            "native threads",
                            f"{per_world['threads']['host']:.2f}",
                            f"{per_world['threads']['member']:.2f}",
                        ],
                        [
                            "RSS KiB",
                            f"{per_world['rss_mib']['host'] * 1024:.0f}",
                            f"{per_world['rss_mib']['member'] * 1024:.0f}",
                        ],
                    ],
                )
            )
            results["per_world"] = per_world
            for role in ("host", "member"):
                targets.append(
                    common.Target(f"{role} idle CPU, {most} worlds", idle[most][role].cpu_pct, CPU_LIMIT_PCT, " %")
                )
            for f in FROZEN:
                targets.append(
                    common.Target(
                        f"{f}: seen in all {most} worlds / in {one}", detect[most][f] / detect[one][f], AS_FAST_AS
                    )
                )
    common.report(
        "heartbeats: requests per interval, idle cost and detection across shared worlds", load, body, targets
    )
    if args.json:
        common.json_line({"heartbeats": results})


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.member == "counter":
        counter()
    elif args.member == "pair":
        pair()
    else:
        return coordinate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
