"""Run inside a network namespace whose only nameserver answers late (test_store_server.py): for
each mode named, serve a store as `multiworld` does (`ours`) or as torch does by default
(`torch`), connect one client, then open and close plain connections to the store while that
client adds to a key. Prints one JSON line: the longest add of each mode."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore

from multiworld.store import server as store_server
from multiworld.store.rules import WORLD_STORE

CHURN_S = 3.0
TIMEOUT = timedelta(seconds=30)


def worst_add(mode: str) -> float:
    if mode == "ours":
        port = store_server.serve(store_server.LOOPBACK, 0, WORLD_STORE).port  # served until the exit
    else:
        server = TCPStore(store_server.LOOPBACK, 0, None, True, TIMEOUT, wait_for_workers=False)
        port = server.port
    client = TCPStore(store_server.LOOPBACK, port, None, False, TIMEOUT)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            socket.create_connection((store_server.LOOPBACK, port)).close()
            stop.wait(0.05)

    threading.Thread(target=churn, daemon=True).start()
    worst, end = 0.0, time.monotonic() + CHURN_S
    while time.monotonic() < end:
        sent = time.monotonic()
        client.add("beat", 1)
        worst = max(worst, time.monotonic() - sent)
        time.sleep(0.01)
    stop.set()
    return worst


if __name__ == "__main__":
    print(json.dumps({mode: worst_add(mode) for mode in sys.argv[1:]}), flush=True)
