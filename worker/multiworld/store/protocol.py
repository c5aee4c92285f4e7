"""torch's TCPStore wire format, as its client (torch.distributed.TCPStore) speaks it: requests
parsed from a connection's bytes, replies encoded. Pure: no sockets.

A request is one byte naming the query, then its fields, with no frame around them: integers
little-endian (the native order of every platform torch ships for), a string or a value as an
8-byte length and its bytes, a list of keys as an 8-byte count and that many strings. torch's
client puts "/" before every key it is given.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

# What a client sends first on a connection: VALIDATE and this number.
VALIDATION_MAGIC = 0x3C85F7CE

# Bounds on what one request may carry; past one the connection is closed. torch's own server
# takes keys of 8 KiB and values of 8 MiB; every key here (a world's, gloo's, NCCL's, the
# failure detector's) is short, and the largest value gloo writes (a rank's addresses for
# every peer) about a hundred and fifty bytes a peer: 300 KiB in a world of the largest spec.
MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 1024 * 1024
MAX_KEYS = 65536
MAX_REQUEST_BYTES = 2 * 1024 * 1024

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


class Query(enum.IntEnum):
    """torch's query types, in its order (c10d::detail::QueryType)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


# Queries this server never answers: listing the keys would tell any client the secret that
# every key of a world's epoch is named under (world/rendezvous.py); nothing of ours, torch's
# process groups' or gloo's uses the queues or the store's barrier.
REFUSED = frozenset({Query.LIST_KEYS, Query.QUEUE_PUSH, Query.QUEUE_POP, Query.QUEUE_LEN, Query.BARRIER})

# The replies to CHECK and WAIT.
READY, NOT_READY = b"\x00", b"\x01"
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"


class Refused(Exception):
    """A request this server does not answer: bytes that are none, a refused query, one past a
    bound or a rule. The connection is closed; `kind` names why in the log."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Request:
    query: Query
    keys: tuple[bytes, ...] = ()
    values: tuple[bytes, ...] = ()
    number: int = 0  # ADD's amount; VALIDATE's and PING's number


class _Incomplete(Exception):
    """The request's bytes have not all arrived yet."""


class _Cursor:
    def __init__(self, data: bytes | bytearray, start: int) -> None:
        self._data = data
        self.at = start

    def take(self, count: int) -> bytes:
        end = self.at + count
        if end > len(self._data):
            raise _Incomplete
        piece = bytes(self._data[self.at : end])
        self.at = end
        return piece

    def unpack(self, form: struct.Struct) -> int:
        value: int = form.unpack(self.take(form.size))[0]
        return value

    def length(self, most: int, what: str) -> int:
        count = self.unpack(_U64)
        if count > most:
            raise Refused("too large", f"{what} of {count} bytes, over {most}")
        return count

    def key(self) -> bytes:
        return self.take(self.length(MAX_KEY_BYTES, "a key"))

    def value(self) -> bytes:
        return self.take(self.length(MAX_VALUE_BYTES, "a value"))

    def keys(self) -> tuple[bytes, ...]:
        count = self.unpack(_U64)
        if count > MAX_KEYS:
            raise Refused("too large", f"{count} keys in one request, over {MAX_KEYS}")
        return tuple(self.key() for _ in range(count))


def parse(data: bytes | bytearray, start: int = 0) -> tuple[Request, int] | None:
    """The request that begins at `start` of `data` and where it ends; None while its bytes
    have not all arrived. Refused for bytes that are none, a refused query, or a request
    past the bounds above."""
    cursor = _Cursor(data, start)
    try:
        request = _fields(cursor)
    except _Incomplete:
        if len(data) - start > MAX_REQUEST_BYTES:
            raise Refused("too large", f"a request of over {MAX_REQUEST_BYTES} bytes") from None
        return None
    return request, cursor.at


def _fields(cursor: _Cursor) -> Request:
    code = cursor.take(1)[0]
    try:
        query = Query(code)
    except ValueError:
        raise Refused("junk", f"no query of type {code}") from None
    if query in REFUSED:
        raise Refused("refused", f"{query.name} is not served")
    if query in (Query.VALIDATE, Query.PING):
        return Request(query, number=cursor.unpack(_U32))
    if query in (Query.GET, Query.DELETE_KEY):
        return Request(query, (cursor.key(),))
    if query in (Query.SET, Query.APPEND):
        return Request(query, (cursor.key(),), (cursor.value(),))
    if query is Query.COMPARE_SET:
        key = cursor.key()
        return Request(query, (key,), (cursor.value(), cursor.value()))
    if query is Query.ADD:
        return Request(query, (cursor.key(),), number=cursor.unpack(_I64))
    if query in (Query.CHECK, Query.WAIT, Query.MULTI_GET):
        return Request(query, cursor.keys())
    if query is Query.MULTI_SET:
        count = cursor.unpack(_U64)
        if count > MAX_KEYS:
            raise Refused("too large", f"{count} keys in one request, over {MAX_KEYS}")
        pairs = [(cursor.key(), cursor.value()) for _ in range(count)]
        return Request(query, tuple(k for k, _ in pairs), tuple(v for _, v in pairs))
    return Request(query)  # GETNUMKEYS, CANCEL_WAIT


def value_reply(value: bytes) -> bytes:
    return _U64.pack(len(value)) + value


def number_reply(number: int) -> bytes:
    return _I64.pack(number)


def ping_reply(number: int) -> bytes:
    return _U32.pack(number)
