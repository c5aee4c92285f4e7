"""A nameserver that answers every query NXDOMAIN after `delay` seconds: a resolver as slow as one
that dropped a query and answered the retry (tests/worker/test_store_server.py runs it in a
network namespace of its own). `python -m tests.support.slow_nameserver ADDRESS DELAY`; prints
"ready" once it listens on ADDRESS:53."""

from __future__ import annotations

import socket
import sys
import threading
import time

# Flags of the answer: a response (QR) to a recursive query (RD, RA), NXDOMAIN.
NXDOMAIN_FLAGS = bytes([0x81, 0x83])
HEADER = 12


def answer(server: socket.socket, query: bytes, peer: tuple[str, int], delay: float) -> None:
    time.sleep(delay)
    question_count = query[4:6]
    server.sendto(query[:2] + NXDOMAIN_FLAGS + question_count + bytes(6) + query[HEADER:], peer)


def main(address: str, delay: float) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind((address, 53))
    print("ready", flush=True)
    while True:
        query, peer = server.recvfrom(512)
        if len(query) > HEADER:
            threading.Thread(target=answer, args=(server, query, peer, delay), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
