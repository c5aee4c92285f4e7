"""Failures and recovery: when a world fails, what it costs, and how it restarts.

- Every world has an epoch, 1 at first. A world that is up (Pending, Running or Recovering and
  not waiting for a backoff) fails when one of its pods fails, disappears after it was seen, or a
  worker reports it broken at its current epoch (reports for other epochs are ignored).
- A failed world gets the next epoch at once, and is restarted now or, from its second restart
  within the failure policy's window, after a backoff: its new pods are made only then, while
  the table already lists the new epoch, so the kept pods wait in it rather than leave a world
  that merely backs off (a world waiting cannot fail again). When the window already holds
  `maxRestarts` restarts the world is Failed for good instead; the others go on. The history
  is bounded (`WorldStatus.with_restart`): the last RECENT_RESTARTS restarts one by one, older
  ones counted per slot of window / RESTART_SLOTS, a slot leaving the window with its newest
  restart: exact up to RECENT_RESTARTS restarts in the window, a restart beyond counted at most
  a slot's width too long.
- A pod instance that ends fails only the worlds whose current epoch it was made for or joined
  (or may have: when nothing says what it joined). A shared pod kept for a world's new epoch
  that dies before joining it fails that world no second time: its replacement joins the epoch.
- Which pods a failure costs (`failurePolicy.replace`). `Pod`, the default: only what is gone.
  A pod that ended is replaced (failed, deleted, or finished before it joined its world's
  current epoch: a program that stops when its world breaks); so is a pod a live peer's report
  names as the culprit, and a kept pod that, `joinTimeout` after its world's epoch opened, has
  neither joined it nor is joining it (a frozen process is Running to Kubernetes). Two pods
  that name each other (a partition, or one broken link) cancel out: neither is named, both
  stay, and the new epoch's join decides between them. A named pod that still holds a rank in
  a healthy world (Running, or one whose current epoch it joined) stays too (a frozen process
  would break that world as well): one report never moves a healthy world; the join timeout
  decides. A world that failed before and has not formed again is not healthy: a pod of two
  worlds whose peers name it one step apart goes at the second report. Every other pod stays and joins the
  new epoch through the table. `World`: a live pod of a world that just failed is also
  replaced when all its worlds have failed (none is up other than by restarting from this
  failure). A replaced pod fails the other worlds whose current epoch it took part in.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from multiworld.contract import JOIN_FAILED, BrokenWorldReport
from multiworld_operator.planner.model import PodObservation
from multiworld_operator.planner.rollout import halt_if_new_template_failed
from multiworld_operator.planner.status import Failure, PodRecord, WorldStatus
from multiworld_operator.planner.step import Step


def recover(step: Step) -> None:
    """End the backoffs that are over, fail the worlds this observation shows failed, and
    replace the pods their failures cost (each replacement recorded in `step.replaced`)."""
    _Recovery(step).run()


def join_deadline(step: Step, name: str, state: WorldStatus) -> datetime | None:
    """When a kept pod of world `name` that is still silent in its epoch gets replaced (None:
    the world is not up)."""
    if not state.up or state.epoch_started is None:
        return None
    return state.epoch_started + timedelta(seconds=step.mw.world(name).failure_policy.join_timeout_seconds)


def silent(step: Step, pod: str, world: str, epoch: int) -> bool:
    """Whether `pod` was kept from an earlier epoch of `world` and its running worker shows
    neither that it joined `epoch` nor that it is joining it (unknown: not silent)."""
    record, seen = step.records.get(pod), step.current(pod)
    if record is None or seen is None or seen.phase != "Running" or seen.joined is None:
        return False
    if record.created_for.get(world, 0) >= epoch:
        return False  # made for this epoch: a slow start is not silence
    return seen.joined.get(world) != epoch and seen.joining.get(world) != epoch


def _took_part(record: PodRecord, seen: PodObservation | None, world: str, epoch: int) -> bool:
    """Whether the pod instance that ended was (or may have been) a rank of `world` at `epoch`."""
    if record.created_for.get(world) == epoch:
        return True
    joined = seen.joined if seen is not None else None
    return joined is None or joined.get(world) == epoch


def _named(report: BrokenWorldReport, state: WorldStatus) -> str | None:
    """The member pod a report names as the culprit, if it names one of the world's ranks."""
    if report.peer_rank is not None and 0 <= report.peer_rank < state.size:
        return state.pods[report.peer_rank]
    return None


class _Recovery:
    """One step's recovery: the worlds that failed in it, and the member pods live peers name as
    the culprit of each."""

    def __init__(self, step: Step) -> None:
        self.step = step
        # Per world: the member pods live peers name as the culprit at its current epoch.
        self.culprits: dict[str, set[str]] = {}
        # Worlds that failed in this step.
        self.failed_now: set[str] = set()

    def run(self) -> None:
        # A world whose backoff ends now is up for this observation, so what it shows (a dead
        # pod, a report) counts once, now, and not only when the same observation is replanned.
        self._end_backoffs()
        failures = self._detect_failures()
        for world, failure in failures.items():
            self._fail(world, failure)
        self._replace_after(failures)
        # A replacement fails the pod's other worlds, which may leave more pods ended before, or
        # silent in, a new epoch: until nothing more goes (each round removes a record).
        replaced = self.step.replaced
        count = -1
        while count != len(replaced):
            count = len(replaced)
            self._replace_ended()
            self._replace_late_joiners()

    def _end_backoffs(self) -> None:
        step = self.step
        for name, state in step.worlds.items():
            if state.restart_at is not None and step.now >= state.restart_at:
                state.restart_at, state.epoch_started = None, step.now
                step.event(
                    "Normal", "WorldRestarting", name, f"world {name} backoff over; restarting at epoch {state.epoch}"
                )

    def _detect_failures(self) -> dict[str, Failure]:
        step = self.step
        failures: dict[str, Failure] = {}
        for pod in step.pods:
            record = step.records.get(pod)
            if record is None:
                continue
            seen = step.observed.get(record.spare or pod)
            current = step.current(pod)  # `seen`, when it is the instance the record asked for
            ours = current is not None
            if not ours and not record.observed:
                continue  # asked for, not created yet (an older instance may linger)
            if current is not None and current.phase != "Failed":
                record.observed = True
                continue
            # Ours failed, or ours was seen and is now gone (or replaced by a foreign instance).
            reason = "PodFailed" if ours else "PodDeleted"
            del step.records[pod]
            if ours:
                halt_if_new_template_failed(step, pod, record, seen)
            instance = record.spare or pod
            for world in step.pod_worlds[pod]:
                state = step.worlds[world]
                if (
                    state.up
                    and world not in failures
                    and _took_part(record, seen if ours else None, world, state.epoch)
                ):
                    rank = state.pods.index(pod)
                    playing = f"playing {pod}, " if record.spare else ""
                    failures[world] = Failure(
                        time=step.now,
                        reason=reason,
                        pod=instance,
                        rank=rank,
                        epoch=state.epoch,
                        message=f"pod {instance} ({playing}rank {rank}) {'failed' if ours else 'was deleted'}"
                        + (f": {seen.message}" if ours and seen is not None and seen.message else ""),
                    )
        accusations: dict[str, dict[str, str]] = {}  # world -> reporting member pod -> the one it names
        for report in step.reports:
            reported = step.worlds.get(report.world)
            if reported is None or not reported.up or report.epoch != reported.epoch:
                continue
            if report.reason.startswith(JOIN_FAILED) and self._a_rank_was_not_running(report, reported):
                continue  # slow scheduling or start-up is not a failure: the members keep waiting
            reporter, named = report.plays or report.pod, _named(report, reported)
            if named is not None and reporter in reported.pods and named != reporter:
                accusations.setdefault(report.world, {})[reporter] = named
            if report.world not in failures:
                failures[report.world] = self._report_failure(report, reported)
        for world, named_by in accusations.items():
            # Two pods that name each other cancel out (see the module's rules).
            self.culprits[world] = {named for by, named in named_by.items() if named_by.get(named) != by}
        return failures

    def _a_rank_was_not_running(self, report: BrokenWorldReport, state: WorldStatus) -> bool:
        """Whether some pod of the world is not running now, or started after the report."""
        for pod in state.pods:
            seen = self.step.observed.get(self.step.playing(pod))
            if seen is None or seen.phase != "Running" or (seen.started is not None and seen.started > report.time):
                return True
        return False

    def _report_failure(self, report: BrokenWorldReport, state: WorldStatus) -> Failure:
        by = f" (reported by {report.pod})" if report.pod else ""
        if report.peer_rank is not None and 0 <= report.peer_rank < state.size:
            pod, rank = self.step.playing(state.pods[report.peer_rank]), report.peer_rank
        else:
            pod, plays = report.pod, report.plays or report.pod
            rank = state.pods.index(plays) if plays in state.pods else -1
        return Failure(
            time=self.step.now,
            reason="WorldBroken",
            pod=pod,
            rank=rank,
            epoch=state.epoch,
            message=f"{report.reason}{by}",
        )

    def _fail(self, world: str, failure: Failure) -> None:
        step = self.step
        state = step.worlds[world]
        policy = step.mw.world(world).failure_policy
        since = step.now - timedelta(seconds=policy.window_seconds)
        state.forget_restarts(since)
        recent = state.restarts_within(since)
        self.failed_now.add(world)
        state.last_failure, state.ready_ranks = failure, 0
        cause = f"world {world} epoch {failure.epoch} failed: {failure.message}"
        if recent >= policy.max_restarts:
            state.phase, state.restart_at = "Failed", None
            step.event(
                "Warning",
                "WorldExhausted",
                world,
                f"{cause}; giving up after {recent} restart(s) within {policy.window}",
            )
            return
        delay = policy.backoff.delay(recent)
        state.epoch += 1
        state.restarts += 1
        state.with_restart(step.now, policy.window_seconds)
        state.phase = "Recovering"
        state.restart_at = step.now + timedelta(seconds=delay) if delay > 0 else None
        state.epoch_started = state.restart_at or step.now
        when = f" in {delay:g}s" if delay > 0 else ""
        step.event(
            "Warning",
            "WorldFailed",
            world,
            f"{cause}; restarting at epoch {state.epoch}{when} "
            f"(restart {recent + 1}/{policy.max_restarts} within {policy.window})",
        )

    # -- which pods a failure costs --------------------------------------------------------

    def _replace_after(self, failures: dict[str, Failure]) -> None:
        """`replace: World`: live pods of a world that just failed go when all their worlds have
        failed (none is up other than by restarting from this very failure). `Pod`: the pods
        live peers named as the culprit go."""
        step = self.step
        for world, failure in failures.items():
            if step.mw.world(world).failure_policy.replace == "World":
                for pod in step.worlds[world].pods:
                    healthy = [w for w in step.pod_worlds[pod] if step.worlds[w].up and w not in failures]
                    if pod in step.records and not healthy:
                        del step.records[pod]
                continue
            for pod in step.worlds[world].pods:
                record = step.records.get(pod)
                if record is not None and not record.observed and not record.spare:
                    del step.records[pod]  # asked for, not made yet: asked again for the new epoch
            for pod in sorted(self.culprits.get(world, ())):
                if not any(self._alive_in(pod, w) for w in step.pod_worlds[pod]):
                    self._replace(
                        pod, f"named by a peer as the culprit of world {world} epoch {failure.epoch}", silent=True
                    )

    def _alive_in(self, pod: str, world: str) -> bool:
        """Whether `pod` holds a rank in `world` that shows it alive: the world did not fail in
        this step and runs, or the pod joined its current epoch. A world that failed in an
        earlier step and has not formed again says nothing of it (a pod of two worlds is named
        by each world's peers in turn, a step apart)."""
        state = self.step.worlds[world]
        if not state.up or world in self.failed_now:
            return False
        return state.phase == "Running" or self.step.ready(pod, world, state.epoch)

    def _replace_ended(self) -> None:
        """A pod that finished before it joined the current epoch of one of its worlds that is up
        and not formed yet at it (its program stopped when that world broke) is replaced. Once a
        world ran at its epoch, a pod that ends is finishing: a finished program leaves its worlds
        first, so what its worker last showed says nothing about the epoch it took part in."""
        step = self.step
        for pod in step.pods:
            seen = step.current(pod)
            if seen is None or seen.phase != "Succeeded":
                continue
            record = step.records[pod]
            for world in step.pod_worlds[pod]:
                state = step.worlds[world]
                if state.up and state.phase != "Running" and not _took_part(record, seen, world, state.epoch):
                    self._replace(pod, f"ended before it joined world {world} epoch {state.epoch}")
                    break

    def _replace_late_joiners(self) -> None:
        """A kept pod (made for an earlier epoch) that, `joinTimeout` after its world's epoch
        opened, has neither joined that epoch nor is joining it is replaced."""
        step = self.step
        for name, state in step.worlds.items():
            deadline = join_deadline(step, name, state)
            if deadline is None or step.now < deadline:
                continue
            timeout = step.mw.world(name).failure_policy.join_timeout
            for pod in state.pods:
                if silent(step, pod, name, state.epoch):
                    self._replace(pod, f"did not join world {name} epoch {state.epoch} within {timeout}", silent=True)

    def _replace(self, pod: str, why: str, silent: bool = False) -> None:
        """Replace member pod `pod`'s instance (`silent`: for its silence, not an exit); every
        other world whose current epoch it took part in fails with it (a shared pod that goes
        breaks each of its worlds)."""
        step = self.step
        record = step.records.get(pod)
        if record is None:
            return
        seen = step.current(pod)
        del step.records[pod]
        instance = record.spare or pod
        step.replaced[pod] = why
        if silent:
            step.silent.add(instance)
        step.event("Normal", "PodReplaced", None, f"pod {instance} replaced: {why}")
        for world in step.pod_worlds[pod]:
            state = step.worlds[world]
            if state.up and world not in self.failed_now and _took_part(record, seen, world, state.epoch):
                rank = state.pods.index(pod)
                self._fail(
                    world,
                    Failure(
                        time=step.now,
                        reason="PodReplaced",
                        pod=instance,
                        rank=rank,
                        epoch=state.epoch,
                        message=f"pod {instance} (rank {rank}) replaced: {why}",
                    ),
                )
