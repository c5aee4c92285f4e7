"""The router: rank 0 of one world per replica. Requests arrive at a steady rate (or all at
once); each replica world has a sender, which hands the replica the oldest waiting request
while it holds fewer than DEPTH, and a receiver, which takes its answers in order. When a
replica's world breaks, the requests it held go back to the front of the queue for the other
replicas (the ledger keeps each request in one place, so none is lost or answered twice); when
the world comes back at a new epoch, its replica gets requests again. A sample of the answers
is checked against the model run here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import common
import wire
from ledger import Answer, Ledger
from model import TOLERANCE, build_model, difference, infer, request_batch
from report import Trace, running_line, summary_lines
from torch import Tensor

from multiworld import MultiWorldError, Work, World, WorldBrokenError

REPORT_EVERY_S = 1.0
# Requests in flight at one replica: one it computes and one on its way, so that it never
# waits for the router between two requests.
DEPTH = 2
# Once every request is answered, how long a broken replica's world may take to come back
# (for its replica to be told to stop) before the router leaves without it.
FINAL_WAIT_S = 60.0


async def completed(*works: Work | None) -> None:
    """Until every op posted (with async_op=True, so each is a Work) is done."""
    for work in works:
        assert work is not None
        await work


@dataclass(frozen=True)
class Settings:
    requests: int
    rate: float  # requests per second arriving; 0: as fast as the replicas answer
    seed: int  # of the model's weights and of the request images
    check_every: int  # every check_every-th request's answer is checked
    trace: Path | None


class Router:
    def __init__(self, source: common.WorldSource, settings: Settings) -> None:
        self.source = source
        self.settings = settings
        self.ledger = Ledger(settings.requests)
        self.changed = asyncio.Condition()  # every change of the ledger
        self.trace = Trace(settings.trace)
        self.model = build_model(settings.seed)
        self.checker = ThreadPoolExecutor(1, thread_name_prefix="check")
        self.checks: list[asyncio.Task[None]] = []
        self.checked = 0
        self.wrong = 0
        self.drives_running = 0
        self.recent: list[Answer] = []  # answers since the last running line
        self.started = 0.0

    # ---- the whole run ---------------------------------------------------------------------

    async def run(self) -> int:
        """Serve every request; returns the exit status (1 when any was lost or answered wrong)."""
        names = self.source.names()
        try:
            worlds = await asyncio.gather(*(self._join(name) for name in names))
            self.started = time.time()
            rate = "as fast as the replicas answer" if self.settings.rate == 0 else f"{self.settings.rate:g} req/s"
            common.say(f"router: {self.settings.requests} requests at {rate} to the replicas of {', '.join(names)}")
            self.trace.write("start", at=self.started, requests=self.settings.requests, rate=self.settings.rate,
                             worlds=names)
            drives = [asyncio.create_task(self._drive(name, world)) for name, world in zip(names, worlds)]
            helpers = [asyncio.create_task(coroutine) for coroutine in (self._arrivals(), self._report())]
            try:
                await self._until_done(names, drives)
            finally:
                for task in (*helpers, *drives):
                    task.cancel()
                await asyncio.gather(*helpers, *drives, return_exceptions=True)
            await asyncio.gather(*self.checks)
            return self._summarize()
        finally:
            self.checker.shutdown()
            self.trace.close()
            self.source.close()

    async def _join(self, name: str) -> World | None:
        try:
            return await self.source.first(name)
        except MultiWorldError as exc:  # a failed rendezvous costs this replica only
            common.say(f"{name} failed to join: {exc}")
            return None

    async def _until_done(self, names: list[str], drives: list[asyncio.Task[None]]) -> None:
        """Until every request is answered and every replica stopped, or no replica is left. A
        drive that fails other than by its world breaking (a bug) ends the run with its error."""
        answered = asyncio.create_task(self._wait_until(lambda: self.ledger.complete))
        waiting: set[asyncio.Task[None]] = {answered, *drives}
        while not answered.done():
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {answered}:
                task.result()
            if waiting == {answered}:  # no replica left
                answered.cancel()
                return
        # Each drive now stops its replica; a world being rebuilt gets time to come back first.
        await asyncio.wait(drives, timeout=FINAL_WAIT_S)
        for name, drive in zip(names, drives):
            if not drive.done():
                common.say(f"{name} was not back within {FINAL_WAIT_S:g} s: its replica was not told to stop")
            elif drive.exception() is not None:
                drive.result()

    def _summarize(self) -> int:
        ledger = self.ledger
        last = max((a.done for a in ledger.answers.values()), default=time.time())
        for line in summary_lines(ledger, max(last - self.started, 1e-9), self.checked, self.wrong):
            common.say(line)
        self.trace.write("end", at=time.time(), served=len(ledger.answers), retried=ledger.retried,
                         lost=ledger.unanswered, duplicates=ledger.duplicates, checked=self.checked, wrong=self.wrong)
        return 0 if ledger.unanswered == 0 and ledger.duplicates == 0 and self.wrong == 0 else 1

    # ---- waiting on the ledger -----------------------------------------------------------

    async def _until(self, ready: Callable[[], bool]) -> None:
        """With the lock held: until `ready()`."""
        while not ready():
            await self.changed.wait()

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        async with self.changed:
            await self._until(ready)

    # ---- one replica ---------------------------------------------------------------------

    async def _drive(self, name: str, world: World | None) -> None:
        """Serve through `name`'s replica until every request is answered, then stop it; after
        a break, go on in the rebuilt world when there is one."""
        self.drives_running += 1
        try:
            while world is not None:
                try:
                    await self._serve(name, world)
                    await common.leave_together(world)
                except WorldBrokenError as exc:
                    await self._give_back(name, exc)
                    # Out of the table need not mean for good: the wait ends with the run.
                    world = await self.source.after_break(name, exc.epoch, through_removal=True)
                    if world is not None:
                        common.say(f"{name} back at epoch {world.epoch}")
                        self.trace.write("back", world=name, epoch=world.epoch, at=time.time())
                    continue
                self.source.finished(name)
                return
            common.say(f"{name} dropped: its replica serves no more")
            self.trace.write("dropped", world=name, at=time.time())
        finally:
            self.drives_running -= 1

    async def _serve(self, name: str, world: World) -> None:
        """Send and receive concurrently until every request is answered and the replica
        acknowledged the stop; raises WorldBrokenError when the world breaks."""
        tasks = [asyncio.create_task(self._send(name, world)), asyncio.create_task(self._receive(name, world))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            task.result()

    async def _send(self, name: str, world: World) -> None:
        device = common.world_device(world)
        while True:
            async with self.changed:
                await self._until(
                    lambda: self.ledger.complete or (self.ledger.waiting > 0 and self.ledger.in_flight(name) < DEPTH))
                if self.ledger.complete:
                    break
                request = self.ledger.take(name, time.time())
                self.changed.notify_all()
            images = request_batch(self.settings.seed, request).to(device)
            # Both posted at once: the replica takes them in order.
            await completed(world.send(wire.header(request, wire.REQUEST, device), dst=wire.REPLICA, async_op=True),
                            world.send(images, dst=wire.REPLICA, async_op=True))
        await completed(world.send(wire.header(-1, wire.STOP, device), dst=wire.REPLICA, async_op=True))

    async def _receive(self, name: str, world: World) -> None:
        device = common.world_device(world)
        header, logits = wire.empty_header(device), wire.empty_logits(device)
        while True:
            # Always posted, with or without requests in flight: a world that breaks fails it
            # at once, and so the requests of a dead replica go to the others at once.
            await completed(world.recv(header, src=wire.REPLICA, async_op=True),
                            world.recv(logits, src=wire.REPLICA, async_op=True))
            if int(header[1]) == wire.STOP:
                return
            async with self.changed:
                answer = self.ledger.answer(name, world.epoch, int(header[0]), time.time())
                self.changed.notify_all()
            if answer is None:
                common.say(f"{name} answered request {int(header[0])} again: not accepted")
                continue
            self.recent.append(answer)
            self.trace.answer(answer, logits)
            if answer.request % self.settings.check_every == 0:
                self._check(answer, logits.cpu().clone())

    async def _give_back(self, name: str, error: WorldBrokenError) -> None:
        async with self.changed:
            count = self.ledger.give_back(name)
            self.changed.notify_all()
        common.say(f"{name} broke: {error.reason}; re-sending its {count} unanswered requests")
        self.trace.write("broke", world=name, epoch=error.epoch, at=time.time(), resent=count)

    # ---- requests arriving, running line, checks -------------------------------------------

    async def _arrivals(self) -> None:
        """Request r arrives at start + r / rate (its latency counts from then, however late
        the router gets to it); with rate 0 every request is there at once."""
        rate = self.settings.rate
        for request in range(self.settings.requests):
            due = None if rate == 0 else self.started + request / rate
            if due is not None and due > time.time():
                await asyncio.sleep(due - time.time())
            async with self.changed:
                self.ledger.arrive(request, due)
                self.changed.notify_all()

    def _lost(self) -> int:
        """Requests no replica can serve any more: all of the unanswered once none is left."""
        return self.ledger.unanswered if self.drives_running == 0 else 0

    async def _report(self) -> None:
        last = time.time()
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            now = time.time()
            recent, self.recent = self.recent, []
            common.say(running_line(self.ledger, self._lost(), recent, now - last))
            self.trace.flush()
            last = now

    def _check(self, answer: Answer, logits: Tensor) -> None:
        computed = asyncio.get_running_loop().run_in_executor(self.checker, self._difference, answer.request, logits)
        self.checks.append(asyncio.create_task(self._checked(answer, computed)))

    def _difference(self, request: int, logits: Tensor) -> float:
        return difference(logits, infer(self.model, request_batch(self.settings.seed, request)))

    async def _checked(self, answer: Answer, computed: asyncio.Future[float]) -> None:
        largest = await computed
        self.checked += 1
        if largest > TOLERANCE:
            self.wrong += 1
            common.say(f"request {answer.request}: wrong answer from {answer.world} at epoch {answer.epoch} "
                       f"(largest difference {largest:.3g})")
        self.trace.write("check", id=answer.request, ok=largest <= TOLERANCE)
