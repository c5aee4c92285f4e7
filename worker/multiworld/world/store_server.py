"""A TCPStore server whose answers never wait on DNS for a peer the machine knows.

torch's store server names each connection it accepts with getnameinfo, a reverse lookup, on
the one thread that answers every client of the store: while the resolver takes its time (a
dropped query costs its whole timeout, 5 s by default), every client of that store waits, the
heartbeats of each world it serves included. torch listens dual-stack, where an IPv4 peer has
an IPv4-mapped IPv6 address that /etc/hosts never lists, so even a loopback peer is looked up
in DNS. Here the store takes a listening socket of ours (`master_listen_fd`): IPv4 unless the
world's members reach it over IPv6, so that loopback and the addresses in /etc/hosts are
answered from that file. Other peers' names are the cluster DNS's to answer
(docs/resource.md). No torch at import.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"
# How long the server's own client waits for an answer.
_OWN_CLIENT_TIMEOUT = timedelta(seconds=60)


@functools.cache
def _own_family() -> socket.AddressFamily:
    """The family of this machine's own address (a pod's, from the hosts file the kubelet
    writes); IPv6 when it has none to name."""
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return socket.AF_INET6
    return socket.AF_INET if any(f == socket.AF_INET for f, *_ in found) else socket.AF_INET6


def listen_family(host: str) -> socket.AddressFamily:
    """The family a store listens on when its members reach it at `host`: an address's own,
    and for a name that of this machine's address."""
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return _own_family()
    return socket.AF_INET if version == 4 else socket.AF_INET6


def serve(host: str, port: int) -> Any:
    """A TCPStore server on `port` (0: one the kernel picks) of every interface, for members
    that reach it at `host`; its own client connects over loopback. OSError when the port
    cannot be had."""
    from torch.distributed import TCPStore

    if listen_family(host) == socket.AF_INET:
        listener = socket.create_server(("0.0.0.0", port))
    else:
        listener = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    bound = listener.getsockname()[1]
    fd = listener.detach()  # the server owns the socket from here on
    try:
        return TCPStore(LOOPBACK, bound, None, True, _OWN_CLIENT_TIMEOUT, wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
