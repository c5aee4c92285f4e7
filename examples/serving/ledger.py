"""Where every request is: not arrived yet, waiting for a replica, in flight at exactly one
replica, or answered. A request is in one place at a time, so it is sent to one replica at a
time and answered at most once; a broken replica's requests go back to the front of the queue.
No I/O here: the router moves requests through it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    """A request answered: by which replica's world (at which epoch), and when (wall clock)."""

    request: int
    world: str
    epoch: int
    arrived: float  # when it reached the router: its latency starts here
    sent: float  # when its last attempt was sent
    done: float  # when its answer was received
    attempts: int  # how many replicas it was sent to

    @property
    def latency(self) -> float:
        return self.done - self.arrived


class OutOfOrderAnswer(RuntimeError):
    """A replica answered a request other than its oldest one: it broke the protocol."""


class Ledger:
    def __init__(self, total: int) -> None:
        self.total = total
        self._waiting: deque[int] = deque()
        self._in_flight: dict[str, deque[int]] = {}
        self._arrived: dict[int, float] = {}
        self._sent: dict[int, float] = {}
        self._attempts: dict[int, int] = {}
        self.answers: dict[int, Answer] = {}
        self.retried = 0  # requests given back by a broken replica, to be sent again
        self.duplicates = 0  # answers to a request already answered (never accepted)

    def arrive(self, request: int, at: float | None) -> None:
        """Request `request` reached the router at `at` (None: its latency starts when it is
        first sent, for a stream that arrives as fast as the replicas take it)."""
        if at is not None:
            self._arrived[request] = at
        self._waiting.append(request)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def in_flight(self, world: str) -> int:
        return len(self._in_flight.get(world, ()))

    def take(self, world: str, now: float) -> int:
        """The oldest waiting request, now in flight at `world`'s replica."""
        request = self._waiting.popleft()
        self._in_flight.setdefault(world, deque()).append(request)
        self._arrived.setdefault(request, now)
        self._sent[request] = now
        self._attempts[request] = self._attempts.get(request, 0) + 1
        return request

    def answer(self, world: str, epoch: int, request: int, now: float) -> Answer | None:
        """`world`'s replica answered `request`, which must be its oldest in flight. None for a
        request answered before (counted as a duplicate, not accepted)."""
        if request in self.answers:
            self.duplicates += 1
            return None
        queue = self._in_flight.get(world)
        if not queue or queue[0] != request:
            expected = queue[0] if queue else "none"
            raise OutOfOrderAnswer(f"{world} answered request {request}, but its oldest in flight is {expected}")
        queue.popleft()
        answer = Answer(request=request, world=world, epoch=epoch, arrived=self._arrived.pop(request),
                        sent=self._sent.pop(request), done=now, attempts=self._attempts.pop(request))
        self.answers[request] = answer
        return answer

    def give_back(self, world: str) -> int:
        """`world` broke: its unanswered requests go back to the front of the queue, oldest
        first. Returns how many."""
        queue = self._in_flight.pop(world, deque())
        self._waiting.extendleft(reversed(queue))
        self.retried += len(queue)
        return len(queue)

    @property
    def complete(self) -> bool:
        return len(self.answers) == self.total

    @property
    def unanswered(self) -> int:
        return self.total - len(self.answers)
