"""A process that holds no rank in a world can neither read nor write its rendezvous state, and
a member of one world cannot disturb the other worlds its rank 0's process hosts (issue 32,
finding 5; docs/security.md, "Each world's rendezvous store").

Rank 0's store answers anything that reaches its port. The attackers here are raw clients (torch's
own, and raw sockets: not multiworld.store) that know what a port scan and the code tell: the
world's name, its store's host and port, its epoch and size, and the beat store's port. One holds
no secret. It tries what was seen to break a world on the node: the abort key written, the epoch
key set to 999, the next epochs' ranks claimed, a verdict written into the beat store; it asks
both stores to list their keys (torch's server lists them all, secrets with them) and writes the
abort key under every prefix a listing shows. The other is a member of the attacked world: it
knows the token of rank 0's process, which names that process's counter and `news` in its beat
store, shared by every world the process hosts; it deletes them and sets them to junk. Meanwhile
the world runs under `multiworld run` and one of its pods is killed: it recovers at the next
epoch as it does with nobody attacking, and the other world, whose rank 0 is the same process,
never moves.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.support import raw_store
from tests.support.journey import RUN_ENV, Fault, Journey, Topology

# A star: m0 (one pod, rank 0 of both worlds: it serves both stores and one beat store), m1 and m2
# (two pods each). The attacker goes for w0; m1-0, a rank of w0, is killed.
TOPOLOGY = Topology(shape="star", replicas=(1, 2, 2), spares=(0, 0, 0), worlds=((0, 1), (0, 2)))
ATTACKED = "w0"
# Rounds of the attack before the kill, and its pause between rounds.
ROUNDS_BEFORE_KILL = 10
ROUND_PAUSE_S = 0.2
FOUND_S = 240.0
VERDICT = json.dumps({"reason": "written by a store client that holds no rank", "by_rank": 0})


def _raw_client(host: str, port: int) -> Any:
    """torch's own client, as any program that reaches the port makes it."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, None, False, timedelta(seconds=10), wait_for_workers=False)


class StoreAttacker:
    """Attacks world `world` of the run `run` from a thread, round after round, until stopped."""

    def __init__(self, run: str, world: str) -> None:
        self.run_name, self.world = run, world
        self.rounds = 0
        # What the attacker could read of the world's state: key -> whether it exists.
        self.read: dict[str, bool] = {}
        # The keys the stores listed to it.
        self.listed: set[bytes] = set()
        # Its world store connections that failed (the store host gone: it connects again).
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-attacker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._attack()
            except (RuntimeError, OSError) as exc:  # torch's DistNetworkError and DistStoreError, a refused connect
                self.errors.append(str(exc).splitlines()[0])
                self._stop.wait(ROUND_PAUSE_S)

    def _host_assignment(self) -> dict[str, Any]:
        """The world's entry in its store host's environment (rank 0's process)."""
        deadline = time.monotonic() + FOUND_S
        while time.monotonic() < deadline and not self._stop.is_set():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                env = dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)
                if env.get(RUN_ENV) == self.run_name and env.get("MULTIWORLD_POD") == f"{self.run_name}-m0-0":
                    for world in json.loads(env.get("MULTIWORLD_WORLDS", "[]")):
                        if world["name"] == self.world:
                            return dict(world)
            time.sleep(0.2)
        raise RuntimeError(f"no store host of {self.world} within {FOUND_S:.0f}s")

    def _connect(self, host: str, port: int) -> Any:
        deadline = time.monotonic() + FOUND_S
        while True:
            try:
                return _raw_client(host, port)
            except RuntimeError:
                if time.monotonic() > deadline or self._stop.is_set():
                    raise
                time.sleep(0.2)

    def _host_entry(self, store: Any, known: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's entry in the world's store, as any member reads it (the port scan finds the
        beat store's port too; the token is a member's knowledge): read under the world's real
        prefix, with the secret its process was given."""
        w, e, secret = known["name"], known["epoch"], known.get("secret", "")
        key = f"{w}/{e}/{secret}/member/0" if secret else f"{w}/{e}/member/0"
        deadline = time.monotonic() + FOUND_S
        while not store.check([key]):
            if time.monotonic() > deadline or self._stop.is_set():
                raise RuntimeError(f"{w} did not form within {FOUND_S:.0f}s")
            time.sleep(0.2)
        return dict(json.loads(store.get(key)))

    def _listed(self, host: str, port: int) -> list[bytes]:
        keys = raw_store.list_keys(host, port) or []
        self.listed.update(keys)
        return keys

    def _attack(self) -> None:
        known = self._host_assignment()
        host, port, epoch, size = known["host"], known["port"], known["epoch"], known["size"]
        store = self._connect(host, port)
        entry = self._host_entry(store, known)
        beat_port, token = int(entry["beat_port"]), str(entry["beat"])
        w = self.world
        # Everything below knows the world's name, epoch and size, and the ports: no secret.
        for key in (f"{w}/{epoch}/member/0", f"{w}/{epoch}/claim/0", f"{w}/{epoch}/abort", f"{w}/epoch"):
            self.read[key] = self.read.get(key, False) or bool(store.check([key]))
        beat_writes = b""
        for e in range(epoch, epoch + 3):
            beat_writes += raw_store.request(
                raw_store.SET, raw_store.string(f"/verdict/{w}/{e}".encode()), raw_store.string(VERDICT.encode())
            )
        while not self._stop.is_set():
            store.set(f"{w}/epoch", "999")
            for e in range(epoch, epoch + 3):
                store.set(f"{w}/{e}/abort", VERDICT)
                for rank in range(size):
                    store.add(f"{w}/{e + 1}/claim/{rank}", 1)  # the next epoch's ranks, claimed first
            for found in self._listed(host, port):  # torch's client puts "/" before each key
                if found.endswith(b"/abort"):
                    store.set(found[1:].decode(), VERDICT)
            raw_store.exchange(host, beat_port, beat_writes, timeout=0.5)
            # The member: rank 0's process's counter and news, and whatever a listing shows.
            shared = {f"/beat/{token}".encode(), f"/news/{token}".encode()} | set(self._listed(host, beat_port))
            for name in shared:
                junk = VERDICT.encode() if name.startswith(b"/verdict/") else b"junk"
                raw_store.exchange(
                    host,
                    beat_port,
                    raw_store.request(raw_store.DELETE_KEY, raw_store.string(name))
                    + raw_store.request(raw_store.SET, raw_store.string(name), raw_store.string(junk)),
                    timeout=0.5,
                )
            self.rounds += 1
            self._stop.wait(ROUND_PAUSE_S)


class AttackedJourney(Journey):
    """The journey's kill waits until the attack has gone on for a while; the attack ends when
    the journey has settled (every world Running with every rank after the kill), before the
    run ends and the stores go."""

    def __init__(self, attacker: StoreAttacker, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attacker = attacker
        self.rounds_before_kill = 0

    def _apply(self, fault: Fault) -> None:
        deadline = time.monotonic() + FOUND_S
        while self.attacker.rounds < ROUNDS_BEFORE_KILL:
            assert time.monotonic() < deadline, (
                f"the attack did not go on for {ROUNDS_BEFORE_KILL} rounds: {self.attacker.rounds} rounds, "
                f"its store connections lost {self.attacker.errors}"
            )
            time.sleep(0.1)
        self.rounds_before_kill = self.attacker.rounds
        super()._apply(fault)

    def _settled(self) -> bool:
        settled = super()._settled()
        if settled:
            self.attacker.stop()
        return settled


def test_a_raw_store_client_without_a_rank_neither_reads_nor_moves_a_world(tmp_path: Path) -> None:
    name = f"sa-{zlib.crc32(str(tmp_path).encode()):08x}"
    attacker = StoreAttacker(name, ATTACKED)
    journey = AttackedJourney(attacker, TOPOLOGY, [Fault("kill", member=1, after=1.0)], tmp_path, name=name)
    attacker.start()
    try:
        summary = journey.run()
    finally:
        attacker.stop()
    said = f"attacker: {attacker.rounds} rounds, {journey.rounds_before_kill} before the kill; errors {attacker.errors}"
    attacked, other = summary["worlds"][ATTACKED], summary["worlds"]["w1"]
    # The kill, and nothing else: one failure, recovered at the next epoch.
    assert (attacked["failures"], attacked["recoveries"], attacked["epoch"]) == (1, 1, 2), (attacked, said)
    assert (other["failures"], other["errors"], other["epoch"]) == (0, 0, 1), (other, said)
    assert not any(attacker.read.values()), (attacker.read, said)
    assert not attacker.listed, (sorted(attacker.listed)[:20], said)
    # It attacked all along, on one connection: the store host was never lost.
    assert journey.rounds_before_kill >= ROUNDS_BEFORE_KILL and attacker.rounds > journey.rounds_before_kill, said
    assert not attacker.errors, said
