"""The typed errors of the worker runtime, and `short`, an error's text made short (no torch)."""

from __future__ import annotations

import re


class MultiWorldError(Exception):
    """Base of every error this library raises on purpose."""


class WorldBrokenError(MultiWorldError):
    """A world (at one epoch) is broken: every pending and new op on it raises this.

    The world is released in the background; join it again at a newer epoch.
    """

    def __init__(self, world: str, epoch: int, reason: str, peer_rank: int | None = None) -> None:
        # Keep the fields as args so copies and pickles rebuild the same error.
        super().__init__(world, epoch, reason, peer_rank)
        self.world = world
        self.epoch = epoch
        self.reason = reason
        self.peer_rank = peer_rank

    def __str__(self) -> str:
        peer = f", peer rank {self.peer_rank}" if self.peer_rank is not None else ""
        return f"world {self.world!r} (epoch {self.epoch}) is broken{peer}: {self.reason}"

    def fresh(self) -> WorldBrokenError:
        """A new instance with the same fields, to raise in one more place without sharing tracebacks."""
        return WorldBrokenError(self.world, self.epoch, self.reason, self.peer_rank)


class UnknownWorldError(MultiWorldError, KeyError, ValueError):
    """The named world is not held by this process."""

    def __init__(self, world: str, detail: str = "") -> None:
        super().__init__(world, detail)
        self.world = world
        self.detail = detail

    def __str__(self) -> str:
        return f"unknown world {self.world!r}" + (f": {self.detail}" if self.detail else "")


class WorldJoinError(MultiWorldError):
    """A rendezvous failed: members disagree, the epoch is stale, a rank is taken, or time ran out."""


class JoinCancelled(WorldJoinError):
    """A join was called off: a newer epoch arrived, the world was left, or the manager closed."""

    def __init__(self, world: str) -> None:
        super().__init__(f"join of world {world!r} was cancelled")


class JoinTimedOut(WorldJoinError):
    """The join timeout passed before every member came (or before rank 0's store answered):
    a peer may be slow to start (its pod still scheduling or pulling its image)."""


class StoreLost(WorldJoinError):
    """The world's store was reached, then failed or went away during the join (on Kubernetes,
    the address may still lead to a replaced rank-0 instance for a moment). Following a live
    table, the join is tried again."""


class StaleEpochError(WorldJoinError):
    """The world has moved on to a newer epoch than the one asked for."""


class UnsupportedOpError(MultiWorldError, NotImplementedError):
    """The world's backend does not implement this op (or this variant of it)."""

    def __init__(self, op: str, backend: str, detail: str = "") -> None:
        super().__init__(op, backend, detail)
        self.op = op
        self.backend = backend
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.op} is not supported by the {self.backend} backend" + (
            f" ({self.detail})" if self.detail else ""
        )


# How torch's backends word a refusal of an op they lack: "... not supported", "not implemented",
# "unsupported", and (torch 2.11's gloo, all_to_all) "Backend gloo does not support alltoall".
_UNSUPPORTED = re.compile(r"not supported|not implemented|unsupported|does not support", re.IGNORECASE)


def says_unsupported(message: str) -> bool:
    """Whether a backend's error message says it lacks the op (see UnsupportedOpError)."""
    return _UNSUPPORTED.search(message) is not None


# "[/path/to/gloo/transport/tcp/pair.cc:553] " at the start of gloo's errors.
_SOURCE_LOCATION = re.compile(r"^\[[^\]]+:\d+\]\s*")


def short(exc: BaseException) -> str:
    """The first line of an error, without gloo's source location and long hints."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = _SOURCE_LOCATION.sub("", text).split(" This is typically caused")[0]
    return text[:300]
