"""The ports of the worlds' stores in a local run (rank 0 of each world serves one)."""

from __future__ import annotations

import itertools
import random
import socket

from multiworld_operator.spec.limits import PORT_BASE, PORT_SPAN


def free_store_ports(count: int) -> list[int]:
    """`count` ports nothing on this machine holds now, one per world's store, drawn at random
    (runs side by side rarely draw the same) from the operator's range, below the kernel's
    ephemeral ports: there only a deliberate bind takes a port. An ephemeral one (what binding
    port 0 picks) can go to any socket of the machine (a listener on port 0, an outgoing
    connection) whenever rank 0 does not serve it, before its first join or after one that
    failed, and rank 0 then fails at every epoch for as long as that socket lives."""
    drawn = (port for port in random.sample(range(PORT_BASE, PORT_BASE + PORT_SPAN), PORT_SPAN) if unheld(port))
    ports = list(itertools.islice(drawn, count))
    if len(ports) < count:
        raise RuntimeError(f"fewer than {count} free ports in {PORT_BASE}-{PORT_BASE + PORT_SPAN - 1}")
    return ports


def unheld(port: int) -> bool:
    """Whether nothing on this machine holds `port` now (on any interface)."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))  # every interface, as rank 0's store listens
        except OSError:
            return False
    return True
