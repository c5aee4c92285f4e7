"""A hostile pod on the pod network that speaks no protocol of ours, run for real in our worker
image by tests/kube/test_adversary_on_node.py (as `python -c`, the standard library only: it
holds no client of the project's).

It scans every TCP port of each host in ADVERSARY_SCAN (the operator's pod, the pods of its own
MultiWorld) and sends each open port a burst of junk, then floods each open port of the hosts in
ADVERSARY_FLOOD (the operator's pod) for as long as it runs: ADVERSARY_HOLD connections a port,
each one silent, junk, a line far past any bound or a line dribbled a byte at a time, every one
the other end closes opened again at once. Before the junk, it asks each open port for its keys
as a TCPStore client would (torch's own store server lists them all). What it does is said in
its log: `scan HOST: open PORTS`, `listed HOST:PORT: N keys` for a port that listed any, `junk
sent`, then `flood: N opened, M closed by the other end` every few seconds.
"""

import errno
import os
import selectors
import socket
import struct
import time
from typing import cast

SCAN = [h for h in os.environ["ADVERSARY_SCAN"].split(",") if h]
FLOOD = [h for h in os.environ["ADVERSARY_FLOOD"].split(",") if h]
HOLD = int(os.environ["ADVERSARY_HOLD"])
BATCH = 2048  # connections a scan tries at once
JUNK = [b"", b"\x00\xff" * 64 + b"\n", b"{" * 300_000, b'{"hello":', b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]


def resolve(host: str) -> str:
    while True:
        try:
            return socket.gethostbyname(host)
        except OSError:
            time.sleep(0.5)


def scan(address: str) -> list[int]:
    """The ports of `address` that accept a connection: non-blocking connects, BATCH at once."""
    found = []
    for first in range(1, 65536, BATCH):
        selector = selectors.DefaultSelector()
        for port in range(first, min(first + BATCH, 65536)):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((address, port))
            selector.register(sock, selectors.EVENT_WRITE, port)
        deadline = time.monotonic() + 2
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(0.2):
                sock = cast(socket.socket, key.fileobj)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    found.append(key.data)
                selector.unregister(sock)
                sock.close()
        for key in list(selector.get_map().values()):
            cast(socket.socket, key.fileobj).close()
        selector.close()
    return sorted(found)


def listed_keys(address: str, port: int) -> int:
    """How many keys the port lists when asked as torch's store client asks (VALIDATE with
    torch's number, then LIST_KEYS: little-endian, a count then length-prefixed keys); 0 when
    it lists none or speaks no such thing."""
    try:
        with socket.create_connection((address, port), timeout=1) as sock:
            sock.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x11")
            reply = sock.recv(8)
    except OSError:
        return 0
    return struct.unpack("<q", reply)[0] if len(reply) == 8 else 0


def junk_burst(address: str, port: int) -> None:
    """Each junk once, on a connection of its own."""
    for payload in JUNK:
        try:
            with socket.create_connection((address, port), timeout=1) as sock:
                sock.sendall(payload)
        except OSError:
            pass


class Flood:
    """HOLD connections to each target, reopened as soon as the other end closes one."""

    def __init__(self, targets: list[tuple[str, int]]) -> None:
        self.selector = selectors.DefaultSelector()
        self.opened = self.closed = 0
        for target in targets:
            for index in range(HOLD):
                self.open(target, index)

    def open(self, target: tuple[str, int], index: int) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        code = sock.connect_ex(target)
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            return
        self.opened += 1
        payload = JUNK[index % len(JUNK)]
        self.selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, [target, index, payload])

    def turn(self) -> None:
        for key, events in self.selector.select(0.05):
            sock, state = cast(socket.socket, key.fileobj), key.data
            target, index, payload = state
            if events & selectors.EVENT_READ:
                try:
                    gone = sock.recv(65536) == b""
                except OSError:
                    gone = True
                if gone:
                    self.selector.unregister(sock)
                    sock.close()
                    self.closed += 1
                    self.open(target, index)
                    continue
            if events & selectors.EVENT_WRITE:
                if not payload:
                    self.selector.modify(sock, selectors.EVENT_READ, state)
                    continue
                dribble = index % len(JUNK) == 3  # a byte at a time
                try:
                    sent = sock.send(payload[:1] if dribble else payload)
                except OSError:
                    sent = len(payload)
                state[2] = payload[sent:]
                if dribble:
                    self.selector.modify(sock, selectors.EVENT_READ, state)


hosts = {host: resolve(host) for host in SCAN + FLOOD}
open_ports = {}
for host in SCAN:
    open_ports[host] = scan(hosts[host])
    print(f"scan {host} ({hosts[host]}): open {open_ports[host]}", flush=True)
for host in SCAN:
    for port in open_ports[host]:
        keys = listed_keys(hosts[host], port)
        if keys > 0:
            print(f"listed {host}:{port}: {keys} keys", flush=True)
        junk_burst(hosts[host], port)
print("junk sent", flush=True)
flood = Flood([(hosts[host], port) for host in FLOOD for port in open_ports.get(host) or scan(hosts[host])])
said = time.monotonic()
dribbled = time.monotonic()
while True:
    flood.turn()
    now = time.monotonic()
    if now - dribbled > 0.5:  # the dribbling connections send their next byte
        dribbled = now
        for key in list(flood.selector.get_map().values()):
            if key.data[2] and key.data[1] % len(JUNK) == 3:
                flood.selector.modify(key.fileobj, selectors.EVENT_READ | selectors.EVENT_WRITE, key.data)
    if now - said > 3:
        said = now
        print(f"flood: {flood.opened} opened, {flood.closed} closed by the other end", flush=True)
