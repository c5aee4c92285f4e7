"""Fault injection for `multiworld run`: planned kills (`--kill` with `--after`) and chaos."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from multiworld_operator.planner import MultiWorldStatus
from multiworld_operator.spec import MultiWorld


@dataclass(frozen=True)
class Kill:
    at: float  # seconds after the run started
    member: str
    ordinal: int | None  # None: a random running replica of the member


def parse_target(text: str) -> tuple[str, int | None]:
    """`MEMBER` or `MEMBER:ORDINAL`."""
    member, _, ordinal = text.partition(":")
    if not member:
        raise ValueError(f"--kill {text!r}: expected MEMBER or MEMBER:ORDINAL")
    if not ordinal:
        return member, None
    if not ordinal.isdigit():
        raise ValueError(f"--kill {text!r}: ORDINAL must be a non-negative integer")
    return member, int(ordinal)


@dataclass(frozen=True)
class SuspendWindow:
    """`--suspend AFTER:FOR`: spec.suspend is true from AFTER seconds after every world first ran,
    for FOR seconds."""

    start: float
    end: float

    def wanted(self, elapsed: float) -> bool:
        return self.start <= elapsed < self.end

    def next_change(self, elapsed: float) -> float | None:
        """Seconds (on the same clock) of the next start or end still ahead of `elapsed`."""
        return next((t for t in (self.start, self.end) if t > elapsed), None)


def parse_suspend(text: str) -> SuspendWindow:
    after, sep, length = text.partition(":")
    try:
        start, span = float(after), float(length)
    except ValueError:
        start = span = -1.0
    if not sep or start < 0 or span <= 0:
        raise ValueError(f"--suspend {text!r}: expected AFTER:FOR, seconds (AFTER >= 0, FOR > 0), e.g. 5:10")
    return SuspendWindow(start, start + span)


def planned_kills(targets: list[str], afters: list[float]) -> list[Kill]:
    """Pair each `--kill` with the `--after` in the same position."""
    if len(targets) != len(afters):
        raise ValueError(f"{len(targets)} --kill and {len(afters)} --after: give one --after SECONDS per --kill")
    if any(a < 0 for a in afters):
        raise ValueError("--after must be >= 0 seconds")
    return [Kill(at, *parse_target(target)) for target, at in zip(targets, afters, strict=True)]


def _chaos(rate_per_minute: float, members: list[str], rng: random.Random) -> Iterator[Kill]:
    """Kills at Poisson times averaging `rate_per_minute`, each of a random member."""
    t = 0.0
    while rate_per_minute > 0 and members:
        t += rng.expovariate(rate_per_minute / 60.0)
        yield Kill(t, rng.choice(members), None)


class FaultSchedule:
    """Planned kills merged with an endless chaos stream, consumed in time order."""

    def __init__(self, kills: list[Kill], chaos_per_minute: float, members: list[str], rng: random.Random) -> None:
        if chaos_per_minute < 0:
            raise ValueError("--chaos must be >= 0 kills per minute")
        self._planned = sorted(kills, key=lambda k: k.at)
        self._chaos = _chaos(chaos_per_minute, members, rng)
        self._next_chaos = next(self._chaos, None)

    def next_at(self) -> float | None:
        times = [k.at for k in self._planned[:1]] + ([self._next_chaos.at] if self._next_chaos else [])
        return min(times) if times else None

    def due(self, elapsed: float) -> list[Kill]:
        due = []
        while self._planned and self._planned[0].at <= elapsed:
            due.append(self._planned.pop(0))
        while self._next_chaos is not None and self._next_chaos.at <= elapsed:
            due.append(self._next_chaos)
            self._next_chaos = next(self._chaos, None)
        return due


def kill_target(
    kill: Kill,
    multiworld: MultiWorld,
    status: MultiWorldStatus | None,
    running: Callable[[str], bool],
    rng: random.Random,
) -> tuple[str, str] | None:
    """The member pod `kill` hits and the process that plays it (a warm spare, where one plays
    it), drawn among the member's pods whose process runs; None when none runs."""
    pods = multiworld.pods_of(kill.member)
    if kill.ordinal is not None:
        pods = [pods[kill.ordinal]]
    playing = {pod: status.played_by_pod(pod) if status else pod for pod in pods}
    pods = [p for p in pods if running(playing[p])]
    if not pods:
        return None
    pod = rng.choice(pods)
    return pod, playing[pod]
