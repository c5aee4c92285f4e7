"""A TCPStore client from raw sockets: torch's wire format written out by hand here (not
multiworld.store.protocol, nor torch's client), for what an attacker sends a store.

A request is a query byte and its fields: little-endian integers, a string as an 8-byte length
and its bytes. A connection begins with VALIDATE and torch's magic number.
"""

from __future__ import annotations

import socket
import struct

VALIDATE, SET, GET, CHECK, DELETE_KEY, LIST_KEYS = 0, 1, 3, 5, 8, 17
MAGIC = 0x3C85F7CE


def string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def request(query: int, *fields: bytes) -> bytes:
    return bytes([query]) + b"".join(fields)


def hello() -> bytes:
    return request(VALIDATE, struct.pack("<I", MAGIC))


def exchange(host: str, port: int, payload: bytes, timeout: float = 5.0) -> bytes:
    """Connect, say hello, send `payload`, and read until the store closes the connection or is
    quiet for `timeout`."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(hello() + payload)
        received = bytearray()
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return bytes(received)


def list_keys(host: str, port: int) -> list[bytes] | None:
    """Every key the store holds, as it lists them; None when it refuses (closes at once)."""
    with socket.create_connection((host, port), timeout=5.0) as sock:
        sock.sendall(hello() + request(LIST_KEYS))
        received = bytearray()
        try:
            while chunk := sock.recv(65536):
                received += chunk
                keys = _keys(bytes(received))
                if keys is not None:
                    return keys
        except (TimeoutError, ConnectionResetError):
            pass
    return None


def _keys(data: bytes) -> list[bytes] | None:
    """The keys of a whole LIST_KEYS reply (a count, then the keys); None while partial."""
    if len(data) < 8:
        return None
    (count,), at, keys = struct.unpack_from("<q", data), 8, []
    for _ in range(count):
        if len(data) < at + 8:
            return None
        (size,) = struct.unpack_from("<Q", data, at)
        if len(data) < at + 8 + size:
            return None
        keys.append(data[at + 8 : at + 8 + size])
        at += 8 + size
    return keys
