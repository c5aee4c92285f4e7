"""The pure decision: spec + previous status + observation -> Plan. No I/O, no clock.

Rules (docs/architecture.md, "Recovery semantics"):
- Every world has an epoch, 1 at first. A world that is up (Pending, Running or Recovering and
  not waiting for a backoff) fails when one of its pods fails, disappears after it was seen, or a
  worker reports it broken at its current epoch (reports for other epochs are ignored).
- A failed world gets the next epoch at once, and is restarted now or, from its second restart
  within the failure policy's window, after a backoff: its new pods are made only then, while
  the table already lists the new epoch, so the kept pods wait in it rather than leave a world
  that merely backs off (a world waiting cannot fail again). When the window already holds
  `maxRestarts` restarts the world is Failed for good instead; the others go on.
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
  a healthy world stays too (a frozen process would break that world as well): one report
  never moves a healthy world; the join timeout decides. Every other pod stays and joins the
  new epoch through the table. `World`: a live pod of a world that just failed is also
  replaced when all its worlds have failed (none is up other than by restarting from this
  failure). A replaced pod fails the other worlds whose current epoch it took part in.
- A pod exists while at least one of its worlds is up (or it finished); pods of Failed worlds
  only, of removed members, or unknown instances are deleted.
- Spec edits: new worlds start at epoch 1, removed ones leave the table, a world whose expanded
  rank list or backend changed gets a new epoch; nothing else moves.
- Suspend (`spec.suspend`): every world that is not Failed or Succeeded is Suspended (out of
  the table, its epoch, history and restart budget kept), so every pod and spare goes; pods
  that go then are no failures. Resuming gives each suspended world its next epoch, and its
  pods are made anew.
- Rollout (`spec.updateStrategy`): a running member pod made from an older template of its
  member is replaced by one of the current template (a ready spare of it plays the pod when
  there is one), while fewer than `maxUnavailable` member pods are not ready; a world whose old
  pods all fit in that room is taken whole, so it moves once. Each replaced pod's worlds get a
  new epoch (no restart counted). `paused` holds it. A pod of the new template that fails while
  old pods remain stops the rollout of its member (the failure policy counts as for any
  failure) until the member's template changes again.
- Warm spares (`spares` of a member): that many pods of the member's template wait for an
  identity. A member pod that needs a new instance is played by the oldest ready spare of its
  member made from its current template (Running, its worker waiting), instead of a new pod of
  its name; with none ready, a new pod is created as without spares. A spare plays one member pod
  for the rest of its life, keeps its own name, and takes that pod's ranks in the table. The pool
  refills once every member pod of a world that is up has joined it (spares would compete with
  them for the machine); spares of an older template, or beyond the count, are deleted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from multiworld.contract import JOIN_FAILED, Backend, BrokenWorldReport, WorldEntry, WorldTable

from ..spec import MultiWorld, spare_name
from .model import (
    Action,
    AssignSpare,
    CreatePod,
    DeletePod,
    EmitEvent,
    Endpoint,
    EventType,
    Observation,
    Plan,
    PodObservation,
    PublishTable,
)
from .status import (
    UP_PHASES,
    Condition,
    ConditionStatus,
    Failure,
    MultiWorldStatus,
    Phase,
    PodRecord,
    RolloutHalt,
    SpareRecord,
    WorldStatus,
    played_by,
)


def plan(
    multiworld: MultiWorld,
    status: MultiWorldStatus | None,
    observation: Observation,
    *,
    endpoint: Endpoint,
    backend_of: Callable[[str], Backend] | None = None,
) -> Plan:
    """Decide the next step. `status` is the one the previous plan returned (None at first);
    `backend_of(world)` defaults to the cluster rule `multiworld.backend_of`."""
    return _Planning(
        multiworld,
        status or MultiWorldStatus(),
        observation,
        endpoint,
        backend_of or multiworld.backend_of,
        first=status is None,
    ).run()


def _took_part(record: PodRecord, seen: PodObservation | None, world: str, epoch: int) -> bool:
    """Whether the pod instance that ended was (or may have been) a rank of `world` at `epoch`."""
    if record.created_for.get(world) == epoch:
        return True
    joined = seen.joined if seen is not None else None
    return joined is None or joined.get(world) == epoch


class _Planning:
    def __init__(
        self,
        multiworld: MultiWorld,
        previous: MultiWorldStatus,
        observation: Observation,
        endpoint: Endpoint,
        backend_of: Callable[[str], Backend],
        first: bool,
    ) -> None:
        self.mw = multiworld
        self.previous = previous
        self.now = observation.now
        self.reports = observation.reports
        self.endpoint = endpoint
        self.backend_of = backend_of
        self.first = first
        self.pods = multiworld.all_pods()
        self.pod_worlds = {pod: multiworld.worlds_of_pod(pod) for pod in self.pods}
        self.observed: dict[str, PodObservation] = {p.name: p for p in observation.pods if p.phase != "Missing"}
        # Shallow copies: the planner assigns fields of its worlds and records, and never changes
        # a list or dict it holds in place, so the previous status stays as it was.
        self.records = {n: r.model_copy() for n, r in previous.pods.items() if n in self.pod_worlds}
        self.pool = {n: r.model_copy() for n, r in previous.spare_pool.items()}
        # A halted rollout stays halted until its member's template changes again.
        members = {m.name for m in multiworld.spec.members}
        self.halted = {
            m: h
            for m, h in previous.rollout_halted.items()
            if m in members and h.template == multiworld.template_digest(m)
        }
        self.spare_serial = previous.spare_serial
        # Per pod: the record last compared with its observed instance, and whether they match.
        # A pod shared by every world carries a stamp per world: comparing it once per world
        # would make a step quadratic in the worlds.
        self._matches: dict[str, tuple[PodRecord, bool]] = {}
        self.worlds: dict[str, WorldStatus] = {}
        self.deletes: list[DeletePod] = []
        self.assigns: list[AssignSpare] = []
        self.creates: list[CreatePod] = []
        self.events: list[EmitEvent] = []
        # Per world: the member pods live peers name as the culprit at its current epoch.
        self.culprits: dict[str, set[str]] = {}
        # Worlds that failed in this step, and why each replaced pod goes.
        self.failed_now: set[str] = set()
        self.updating: set[str] = set()  # worlds a rollout moved to a new epoch in this step
        self.replaced: dict[str, str] = {}

    def run(self) -> Plan:
        self._apply_spec()
        self._suspend_or_resume()
        # A world whose backoff ends now is up for this observation, so what it shows (a dead
        # pod, a report) counts once, now, and not only when the same observation is replanned.
        self._end_backoffs()
        failures = self._detect_failures()
        for world, failure in failures.items():
            self._fail(world, failure)
        self._replace_after(failures)
        # A replacement fails the pod's other worlds, which may leave more pods ended before, or
        # silent in, a new epoch: until nothing more goes (each round removes a record).
        replaced = -1
        while replaced != len(self.replaced):
            replaced = len(self.replaced)
            self._replace_ended()
            self._replace_late_joiners()
        self._roll_out()
        self._finish_worlds()
        self._assign_spares()
        table = self._table()
        self._reconcile_pods(table)
        self._keep_spares()
        self._count_ready()
        status = self._status(table)
        actions: list[Action] = [*self.deletes, *self.assigns]
        if table != self.previous.table:
            actions.append(PublishTable(table=table))
        actions += [*self.creates, *self.events]
        return Plan(actions=actions, status=status, requeue_after=self._requeue_after())

    # -- worlds ------------------------------------------------------------------------------

    def _apply_spec(self) -> None:
        for world in self.mw.spec.worlds:
            pods, backend = self.mw.world_pods(world.name), self.backend_of(world.name)
            old = self.previous.worlds.get(world.name)
            if old is None:
                self.worlds[world.name] = WorldStatus(
                    size=len(pods), pods=pods, backend=backend, epoch_started=self.now
                )
                if not self.first:
                    self._event("Normal", "WorldAdded", world.name, f"world {world.name} added with {len(pods)} ranks")
                continue
            current = old.model_copy()
            if current.epoch_started is None:  # a status written before the field existed
                current.epoch_started = self.now
            if old.pods != pods or old.backend != backend:
                current.epoch += 1
                current.size, current.pods, current.backend = len(pods), pods, backend
                current.ready_ranks = 0
                if current.phase == "Failed":
                    # An edited definition gets a fresh restart budget.
                    current.recent_restarts, current.restart_at = [], None
                if current.restart_at is None:
                    current.phase, current.epoch_started = "Pending", self.now
                self._event(
                    "Normal",
                    "WorldChanged",
                    world.name,
                    f"world {world.name} changed ({len(pods)} ranks, {backend}); now at epoch {current.epoch}",
                )
            self.worlds[world.name] = current
        for name in self.previous.worlds:
            if name not in self.worlds:
                self._event("Normal", "WorldRemoved", name, f"world {name} removed from the spec")

    def _suspend_or_resume(self) -> None:
        suspend = self.mw.spec.suspend
        for name, state in self.worlds.items():
            if suspend and state.phase in UP_PHASES:
                state.phase, state.restart_at, state.ready_ranks, state.waiting = "Suspended", None, 0, {}
                self._event("Normal", "WorldSuspended", name, f"world {name} suspended at epoch {state.epoch}")
            elif not suspend and state.phase == "Suspended":
                state.epoch += 1
                state.phase, state.epoch_started = "Pending", self.now
                self._event("Normal", "WorldResumed", name, f"world {name} resumed at epoch {state.epoch}")
        if suspend:
            # Every pod goes (none of them is a failure); the spare pool empties by its count.
            self.records.clear()

    def _detect_failures(self) -> dict[str, Failure]:
        failures: dict[str, Failure] = {}
        for pod in self.pods:
            record = self.records.get(pod)
            if record is None:
                continue
            seen = self.observed.get(record.spare or pod)
            current = self._current(pod)  # `seen`, when it is the instance the record asked for
            ours = current is not None
            if not ours and not record.observed:
                continue  # asked for, not created yet (an older instance may linger)
            if current is not None and current.phase != "Failed":
                record.observed = True
                continue
            # Ours failed, or ours was seen and is now gone (or replaced by a foreign instance).
            reason = "PodFailed" if ours else "PodDeleted"
            del self.records[pod]
            if ours:
                self._halt_if_new_template_failed(pod, record, seen)
            instance = record.spare or pod
            for world in self.pod_worlds[pod]:
                state = self.worlds[world]
                if (
                    state.up
                    and world not in failures
                    and _took_part(record, seen if ours else None, world, state.epoch)
                ):
                    rank = state.pods.index(pod)
                    playing = f"playing {pod}, " if record.spare else ""
                    failures[world] = Failure(
                        time=self.now,
                        reason=reason,
                        pod=instance,
                        rank=rank,
                        epoch=state.epoch,
                        message=f"pod {instance} ({playing}rank {rank}) {'failed' if ours else 'was deleted'}"
                        + (f": {seen.message}" if ours and seen is not None and seen.message else ""),
                    )
        accusations: dict[str, dict[str, str]] = {}  # world -> reporting member pod -> the one it names
        for report in self.reports:
            reported = self.worlds.get(report.world)
            if reported is None or not reported.up or report.epoch != reported.epoch:
                continue
            if report.reason.startswith(JOIN_FAILED) and self._a_rank_was_not_running(report, reported):
                continue  # slow scheduling or start-up is not a failure: the members keep waiting
            reporter, named = report.plays or report.pod, self._named(report, reported)
            if named is not None and reporter in reported.pods and named != reporter:
                accusations.setdefault(report.world, {})[reporter] = named
            if report.world not in failures:
                failures[report.world] = self._report_failure(report, reported)
        for world, named_by in accusations.items():
            # Two pods that name each other cancel out (see the module's rules).
            self.culprits[world] = {named for by, named in named_by.items() if named_by.get(named) != by}
        return failures

    @staticmethod
    def _named(report: BrokenWorldReport, state: WorldStatus) -> str | None:
        """The member pod a report names as the culprit, if it names one of the world's ranks."""
        if report.peer_rank is not None and 0 <= report.peer_rank < state.size:
            return state.pods[report.peer_rank]
        return None

    def _a_rank_was_not_running(self, report: BrokenWorldReport, state: WorldStatus) -> bool:
        """Whether some pod of the world is not running now, or started after the report."""
        for pod in state.pods:
            seen = self.observed.get(self._playing(pod))
            if seen is None or seen.phase != "Running" or (seen.started is not None and seen.started > report.time):
                return True
        return False

    def _report_failure(self, report: BrokenWorldReport, state: WorldStatus) -> Failure:
        by = f" (reported by {report.pod})" if report.pod else ""
        if report.peer_rank is not None and 0 <= report.peer_rank < state.size:
            pod, rank = self._playing(state.pods[report.peer_rank]), report.peer_rank
        else:
            pod, plays = report.pod, report.plays or report.pod
            rank = state.pods.index(plays) if plays in state.pods else -1
        return Failure(
            time=self.now, reason="WorldBroken", pod=pod, rank=rank, epoch=state.epoch, message=f"{report.reason}{by}"
        )

    def _fail(self, world: str, failure: Failure) -> None:
        state = self.worlds[world]
        policy = self.mw.world(world).failure_policy
        since = self.now - timedelta(seconds=policy.window_seconds)
        recent = [t for t in state.recent_restarts if t > since]
        self.failed_now.add(world)
        state.last_failure, state.recent_restarts, state.ready_ranks = failure, recent, 0
        cause = f"world {world} epoch {failure.epoch} failed: {failure.message}"
        if len(recent) >= policy.max_restarts:
            state.phase, state.restart_at = "Failed", None
            self._event(
                "Warning",
                "WorldExhausted",
                world,
                f"{cause}; giving up after {len(recent)} restart(s) within {policy.window}",
            )
            return
        delay = policy.backoff.delay(len(recent))
        state.epoch += 1
        state.restarts += 1
        state.recent_restarts = [*recent, self.now]
        state.phase = "Recovering"
        state.restart_at = self.now + timedelta(seconds=delay) if delay > 0 else None
        state.epoch_started = state.restart_at or self.now
        when = f" in {delay:g}s" if delay > 0 else ""
        self._event(
            "Warning",
            "WorldFailed",
            world,
            f"{cause}; restarting at epoch {state.epoch}{when} "
            f"(restart {len(state.recent_restarts)}/{policy.max_restarts} within {policy.window})",
        )

    def _end_backoffs(self) -> None:
        for name, state in self.worlds.items():
            if state.restart_at is not None and self.now >= state.restart_at:
                state.restart_at, state.epoch_started = None, self.now
                self._event(
                    "Normal", "WorldRestarting", name, f"world {name} backoff over; restarting at epoch {state.epoch}"
                )

    # -- rollout -----------------------------------------------------------------------------

    def _outdated(self, pod: str) -> bool:
        """Whether member pod `pod` runs an instance made from an older template of its member."""
        record = self.records.get(pod)
        if record is None or not record.observed or not record.template:
            return False
        return record.template != self.mw.template_digest(self.mw.member_of_pod(pod)[0])

    def _halt_if_new_template_failed(self, pod: str, record: PodRecord, seen: PodObservation | None) -> None:
        member = self.mw.member_of_pod(pod)[0]
        digest = self.mw.template_digest(member)
        rolling = any(self._outdated(p) for p in self.mw.pods_of(member))
        if record.template == digest and rolling and member not in self.halted:
            why = f"pod {record.spare or pod} of member {member}'s new template failed" + (
                f": {seen.message}" if seen is not None and seen.message else ""
            )
            self.halted[member] = RolloutHalt(template=digest, reason=why)
            self._event("Warning", "RolloutHalted", None, f"rollout of member {member} stopped: {why}")

    def _roll_out(self) -> None:
        strategy = self.mw.spec.update_strategy
        # A member that keeps warm spares rolls only onto ready spares of its new template: each
        # pod then costs its worlds about one recovery, not a new pod's start.
        spares_left = {m.name: self._ready_spares(m.name) for m in self.mw.spec.members if m.spares}
        outdated = []
        for pod in self.pods:
            member = self.mw.member_of_pod(pod)[0]
            if not self._outdated(pod) or member in self.halted:
                continue
            if member in spares_left:
                if spares_left[member] == 0:
                    continue
                spares_left[member] -= 1
            outdated.append(pod)
        if not outdated or strategy.paused or self.mw.spec.suspend:
            return
        room = strategy.max_unavailable - sum(self._unavailable(p) for p in self.pods)
        old = set(outdated)  # sets: a world's pods are looked up in them once per world
        chosen: list[str] = []
        taken: set[str] = set()
        # Whole worlds first: a world whose old pods all fit in the room moves once.
        for world in self.mw.spec.worlds:
            pods = [p for p in self.worlds[world.name].pods if p in old and p not in taken]
            if pods and len(chosen) + len(pods) <= room:
                chosen += pods
                taken.update(pods)
        if not chosen and room > 0:
            chosen = outdated[:room]
        for pod in chosen:
            self._update(pod)

    def _unavailable(self, pod: str) -> bool:
        """Whether member pod `pod` is not ready in one of its worlds that is up."""
        return any(self.worlds[w].up and not self._ready(pod, w, self.worlds[w].epoch) for w in self.pod_worlds[pod])

    def _update(self, pod: str) -> None:
        """Replace `pod` by an instance of its member's current template; each of its worlds that
        is up goes to a new epoch (no restart is counted)."""
        record = self.records.pop(pod)
        member = self.mw.member_of_pod(pod)[0]
        instance = record.spare or pod
        self.replaced[pod] = f"rolling out member {member}'s new template"
        self._event("Normal", "PodUpdated", None, f"pod {instance} replaced by one of member {member}'s new template")
        for world in self.pod_worlds[pod]:
            state = self.worlds[world]
            if state.up and world not in self.updating:
                self.updating.add(world)
                state.epoch += 1
                state.phase, state.ready_ranks, state.epoch_started = "Pending", 0, self.now
                self._event(
                    "Normal", "WorldUpdating", world, f"world {world} moves to epoch {state.epoch} for the rollout"
                )

    # -- which pods a failure costs --------------------------------------------------------

    def _replace_after(self, failures: dict[str, Failure]) -> None:
        """`replace: World`: live pods of a world that just failed go when all their worlds have
        failed (none is up other than by restarting from this very failure). `Pod`: the pods
        live peers named as the culprit go."""
        for world, failure in failures.items():
            if self.mw.world(world).failure_policy.replace == "World":
                for pod in self.worlds[world].pods:
                    healthy = [w for w in self.pod_worlds[pod] if self.worlds[w].up and w not in failures]
                    if pod in self.records and not healthy:
                        del self.records[pod]
                continue
            for pod in self.worlds[world].pods:
                record = self.records.get(pod)
                if record is not None and not record.observed and not record.spare:
                    del self.records[pod]  # asked for, not made yet: asked again for the new epoch
            for pod in sorted(self.culprits.get(world, ())):
                if not any(self.worlds[w].up and w not in self.failed_now for w in self.pod_worlds[pod]):
                    self._replace(pod, f"named by a peer as the culprit of world {world} epoch {failure.epoch}")

    def _replace_ended(self) -> None:
        """A pod that finished before it joined the current epoch of one of its worlds that is up
        and not formed yet at it (its program stopped when that world broke) is replaced. Once a
        world ran at its epoch, a pod that ends is finishing: a finished program leaves its worlds
        first, so what its worker last showed says nothing about the epoch it took part in."""
        for pod in self.pods:
            seen = self._current(pod)
            if seen is None or seen.phase != "Succeeded":
                continue
            record = self.records[pod]
            for world in self.pod_worlds[pod]:
                state = self.worlds[world]
                if state.up and state.phase != "Running" and not _took_part(record, seen, world, state.epoch):
                    self._replace(pod, f"ended before it joined world {world} epoch {state.epoch}")
                    break

    def _replace_late_joiners(self) -> None:
        """A kept pod (made for an earlier epoch) that, `joinTimeout` after its world's epoch
        opened, has neither joined that epoch nor is joining it is replaced."""
        for name, state in self.worlds.items():
            deadline = self._join_deadline(name, state)
            if deadline is None or self.now < deadline:
                continue
            timeout = self.mw.world(name).failure_policy.join_timeout
            for pod in state.pods:
                if self._silent(pod, name, state.epoch):
                    self._replace(pod, f"did not join world {name} epoch {state.epoch} within {timeout}")

    def _join_deadline(self, name: str, state: WorldStatus) -> datetime | None:
        """When a kept pod of world `name` that is still silent in its epoch gets replaced (None:
        the world is not up)."""
        if not state.up or state.epoch_started is None:
            return None
        return state.epoch_started + timedelta(seconds=self.mw.world(name).failure_policy.join_timeout_seconds)

    def _silent(self, pod: str, world: str, epoch: int) -> bool:
        """Whether `pod` was kept from an earlier epoch of `world` and its running worker shows
        neither that it joined `epoch` nor that it is joining it (unknown: not silent)."""
        record, seen = self.records.get(pod), self._current(pod)
        if record is None or seen is None or seen.phase != "Running" or seen.joined is None:
            return False
        if record.created_for.get(world, 0) >= epoch:
            return False  # made for this epoch: a slow start is not silence
        return seen.joined.get(world) != epoch and seen.joining.get(world) != epoch

    def _replace(self, pod: str, why: str) -> None:
        """Replace member pod `pod`'s instance; every other world whose current epoch it took
        part in fails with it (a shared pod that goes breaks each of its worlds)."""
        record = self.records.get(pod)
        if record is None:
            return
        seen = self._current(pod)
        del self.records[pod]
        instance = record.spare or pod
        self.replaced[pod] = why
        self._event("Normal", "PodReplaced", None, f"pod {instance} replaced: {why}")
        for world in self.pod_worlds[pod]:
            state = self.worlds[world]
            if state.up and world not in self.failed_now and _took_part(record, seen, world, state.epoch):
                rank = state.pods.index(pod)
                self._fail(
                    world,
                    Failure(
                        time=self.now,
                        reason="PodReplaced",
                        pod=instance,
                        rank=rank,
                        epoch=state.epoch,
                        message=f"pod {instance} (rank {rank}) replaced: {why}",
                    ),
                )

    # -- pods --------------------------------------------------------------------------------

    def _table(self) -> WorldTable:
        entries = []
        for name, state in self.worlds.items():
            if state.phase in UP_PHASES:  # a world backing off included: see the module's rules
                pods = [self._playing(pod) for pod in state.pods]
                host, port = self.endpoint(name, pods[0])
                entries.append(
                    WorldEntry(
                        name=name,
                        epoch=state.epoch,
                        backend=state.backend,
                        host=host,
                        port=port,
                        pods=pods,
                        instances=self._instances(name, state.pods),
                        plays={p: pod for p, pod in zip(pods, state.pods, strict=True) if p != pod},
                    )
                )
        revision = self.previous.table.revision
        if entries != self.previous.table.worlds:
            revision += 1
        return WorldTable(revision=revision, worlds=entries)

    def _instances(self, world: str, pods: list[str]) -> dict[str, int]:
        """The epoch of `world` each pod's current instance was created for: a kept pod's record
        says; a pod without one (being replaced) gets an instance for the current epoch."""
        found = {}
        for pod in pods:
            record = self.records.get(pod)
            epoch = record.created_for.get(world) if record is not None else self.worlds[world].epoch
            if epoch is not None:
                found[self._playing(pod)] = epoch
        return found

    def _playing(self, pod: str) -> str:
        return played_by(self.records, pod)

    def _reconcile_pods(self, table: WorldTable) -> None:
        for pod in self.pods:
            worlds = self.pod_worlds[pod]
            if all(self.worlds[w].phase == "Failed" for w in worlds):
                self.records.pop(pod, None)
            record, seen = self.records.get(pod), self.observed.get(pod)
            if seen is not None:
                if record is None or record.spare or seen.created_for != record.created_for:
                    self.deletes.append(DeletePod(pod=pod, reason=self._delete_reason(seen, record)))
                continue
            if record is None and any(self.worlds[w].up for w in worlds):
                record = PodRecord(
                    created_for={w: self.worlds[w].epoch for w in worlds},
                    template=self.mw.template_digest(self.mw.member_of_pod(pod)[0]),
                )
                self.records[pod] = record
            if record is not None and not record.observed:
                member, ordinal = self.mw.member_of_pod(pod)
                self.creates.append(
                    CreatePod(
                        pod=pod,
                        member=member,
                        ordinal=ordinal,
                        created_for=record.created_for,
                        worlds=list(table.assignments_for(pod).values()),
                        template=self.mw.template_of(member),
                    )
                )
        playing = {r.spare: pod for pod, r in self.records.items() if r.spare}
        for name in sorted(set(self.observed) - set(self.pod_worlds) - set(self.pool) - set(playing)):
            self.deletes.append(DeletePod(pod=name, reason=self._stray_reason(name)))

    def _stray_reason(self, name: str) -> str:
        """Why an observed pod that is no member pod, no pool spare and plays nothing goes."""
        played = next((pod for pod, r in self.previous.pods.items() if r.spare == name), None)
        if played is None:
            return "not part of the spec"
        return f"a warm spare that played {played}: " + (
            "failed" if self.observed[name].phase == "Failed" else "no longer needed"
        )

    def _delete_reason(self, seen: PodObservation, record: PodRecord | None) -> str:
        if record is not None and record.spare:
            return f"replaced by warm spare {record.spare}"
        if seen.name in self.replaced:
            return self.replaced[seen.name]
        if self.mw.spec.suspend:
            return "the MultiWorld is suspended (spec.suspend)"
        wanted = any(self.worlds[w].up for w in self.pod_worlds[seen.name])
        if seen.phase == "Failed":
            return "failed; replaced by a new instance" if wanted else "failed"
        if record is None and not wanted:
            return "no world of this pod is running"
        return "an outdated instance; replaced by a new one"

    def _current(self, pod: str) -> PodObservation | None:
        """The pod as observed, when it is the instance its record asked for."""
        record = self.records.get(pod)
        if record is None:
            return None
        seen = self.observed.get(record.spare or pod)
        if seen is None:
            return None
        known = self._matches.get(pod)
        if known is None or known[0] is not record:
            # A spare's name is never reused: the pod of that name is the one that was assigned.
            known = (record, record.spare is not None or seen.created_for == record.created_for)
            self._matches[pod] = known
        return seen if known[1] else None

    def _ready(self, pod: str, world: str, epoch: int) -> bool:
        seen = self._current(pod)
        if seen is None or seen.phase != "Running":
            return False
        return seen.joined is None or seen.joined.get(world) == epoch

    def _finished(self, pod: str) -> bool:
        seen = self._current(pod)
        return seen is not None and seen.phase == "Succeeded"

    def _finish_worlds(self) -> None:
        for name, state in self.worlds.items():
            if state.up and all(self._finished(pod) for pod in state.pods):
                state.phase, state.ready_ranks = "Succeeded", 0
                self._event("Normal", "WorldSucceeded", name, f"world {name}: every rank finished")

    def _count_ready(self) -> None:
        for name, state in self.worlds.items():
            if not state.up:
                continue
            state.ready_ranks = sum(self._ready(pod, name, state.epoch) for pod in state.pods)
            self._note_waiting(name, state)
            if state.ready_ranks == state.size and state.phase != "Running":
                recovered = state.phase == "Recovering"
                how = "back" if recovered else "ready"
                self._event(
                    "Normal",
                    "WorldRecovered" if recovered else "WorldReady",
                    name,
                    f"world {name} {how} with all {state.size} ranks at epoch {state.epoch}",
                )
                state.phase = "Running"

    def _note_waiting(self, name: str, state: WorldStatus) -> None:
        """The world's pods that are not running yet, with why; an Event once per epoch when one
        waits for a reason beyond a container starting (unschedulable, an image pull, ...)."""
        waiting = {}
        for pod in state.pods:
            seen = self.observed.get(self._playing(pod))
            if seen is None:
                waiting[pod] = "not created yet"
            elif seen.phase == "Pending":
                waiting[pod] = seen.waiting or "Pending"
        before = self.previous.worlds.get(name)
        told = (
            before is not None
            and before.epoch == state.epoch
            and any(_worth_telling(r) for r in before.waiting.values())
        )
        state.waiting = waiting
        stuck = {pod: reason for pod, reason in waiting.items() if _worth_telling(reason)}
        if stuck and not told:
            self._event(
                "Warning",
                "WorldWaiting",
                name,
                f"world {name} epoch {state.epoch} waits for "
                + "; ".join(f"pod {pod}: {reason}" for pod, reason in stuck.items()),
            )

    # -- warm spares -------------------------------------------------------------------------

    def _ready_spares(self, member: str) -> int:
        return sum(self._ready_spare(name, spare, member) for name, spare in self.pool.items())

    def _ready_spare(self, name: str, spare: SpareRecord, member: str) -> bool:
        seen = self.observed.get(name)
        return (
            spare.member == member
            and spare.template == self.mw.template_digest(member)
            and seen is not None
            and seen.phase == "Running"
            and seen.warm
        )

    def _assign_spares(self) -> None:
        """A member pod that needs a new instance is played by its member's oldest ready spare."""
        for pod in self.pods:
            worlds = self.pod_worlds[pod]
            if pod in self.records or not any(self.worlds[w].up for w in worlds):
                continue
            member, ordinal = self.mw.member_of_pod(pod)
            if not self.mw.member(member).spares:
                continue
            ready = sorted(
                (spare.serial, name) for name, spare in self.pool.items() if self._ready_spare(name, spare, member)
            )
            if not ready:
                continue
            spare = ready[0][1]
            self.records[pod] = PodRecord(
                created_for={w: self.worlds[w].epoch for w in worlds},
                observed=True,
                spare=spare,
                template=self.pool.pop(spare).template,
            )
            self.assigns.append(AssignSpare(pod=spare, plays=pod, member=member, ordinal=ordinal))
            self._event("Normal", "SpareAssigned", None, f"warm spare {spare} plays {pod} (worlds {', '.join(worlds)})")

    def _keep_spares(self) -> None:
        """Each member's pool holds `spares` spares of its current template: gone or ended ones
        are dropped, outdated or surplus ones deleted, missing ones created (once no member pod
        is starting)."""
        members = {m.name: m for m in self.mw.spec.members}
        wanted = {name: self._spares_wanted(name) for name, m in members.items() if m.spares}
        kept: dict[str, list[str]] = {name: [] for name in members}
        for name, spare in sorted(self.pool.items(), key=lambda item: item[1].serial):
            seen = self.observed.get(name)
            member = members.get(spare.member)
            why = None
            if seen is None and spare.observed:
                why = "gone"
            elif seen is not None and seen.phase in ("Failed", "Succeeded"):
                why = "a warm spare that ended before it played a member pod"
            elif member is None:
                why = f"a warm spare of member {spare.member}, no longer in the spec"
            elif spare.template != self.mw.template_digest(member.name):
                why = f"a warm spare of an older template of member {member.name}"
            elif len(kept[member.name]) >= wanted.get(member.name, 0):
                why = f"a warm spare beyond the {wanted.get(member.name, 0)} member {member.name} keeps now"
            if why is None:
                assert member is not None
                kept[member.name].append(name)
                spare.observed = spare.observed or seen is not None
                if seen is None:
                    self.creates.append(self._create_spare(name, member.name))
                continue
            del self.pool[name]
            if seen is not None:
                self.deletes.append(DeletePod(pod=name, reason=why))
        missing = {member: count - len(kept[member]) for member, count in wanted.items() if count > len(kept[member])}
        if not missing or self._member_pods_starting():
            return
        for member_name, count in missing.items():
            for _ in range(count):
                name = spare_name(self.mw.name, member_name, self.spare_serial)
                self.pool[name] = SpareRecord(
                    member=member_name, template=self.mw.template_digest(member_name), serial=self.spare_serial
                )
                self.spare_serial += 1
                self.creates.append(self._create_spare(name, member_name))

    def _spares_wanted(self, member: str) -> int:
        """The member's `spares` while one of its worlds may still need a pod (is not Failed,
        Succeeded or Suspended); else none."""
        worlds = self.mw.worlds_of_member(member)
        return self.mw.member(member).spares if any(self.worlds[w].phase in UP_PHASES for w in worlds) else 0

    def _create_spare(self, name: str, member: str) -> CreatePod:
        return CreatePod(
            pod=name,
            member=member,
            ordinal=None,
            created_for={},
            worlds=[],
            template=self.mw.template_of(member),
            spare=True,
        )

    def _member_pods_starting(self) -> bool:
        """Whether a member pod of a world that is up has not joined it yet (a local process
        runs from the moment it is spawned: its imports are still ahead of it)."""
        for pod in self.pods:
            for world in self.pod_worlds[pod]:
                state = self.worlds[world]
                if state.up and not self._ready(pod, world, state.epoch):
                    return True
        return False

    # -- status ------------------------------------------------------------------------------

    def _status(self, table: WorldTable) -> MultiWorldStatus:
        phases = [s.phase for s in self.worlds.values()]
        running = phases.count("Running")
        phase: Phase = "Suspended" if self.mw.spec.suspend else _overall_phase(phases)
        degraded = [n for n, s in self.worlds.items() if s.phase in ("Failed", "Recovering")]
        conditions = [
            self._condition(
                "Ready",
                phase == "Running",
                "AllWorldsRunning" if phase == "Running" else f"Phase{phase}",
                f"{running}/{len(phases)} worlds running",
            ),
            self._condition(
                "Degraded",
                bool(degraded),
                "WorldsUnhealthy" if degraded else "AllWorldsHealthy",
                ("not healthy: " + ", ".join(degraded)) if degraded else "no failed or recovering world",
            ),
        ]
        updated = self._updated()
        progressing = self._progressing(updated)
        if progressing is not None:
            conditions.append(progressing)
        if self.mw.spec.suspend or self.previous.condition("Suspended") is not None:
            suspended = self.mw.spec.suspend
            conditions.append(
                self._condition(
                    "Suspended",
                    suspended,
                    "SpecSuspend" if suspended else "Resumed",
                    "spec.suspend is true: no pod runs; each world keeps its history"
                    if suspended
                    else "spec.suspend is false",
                )
            )
        generation = self.mw.metadata.generation
        return MultiWorldStatus(
            phase=phase,
            observed_generation=generation if generation is not None else self.previous.observed_generation,
            worlds_ready=f"{running}/{len(phases)}",
            restarts=sum(s.restarts for s in self.worlds.values()),
            worlds=self.worlds,
            conditions=conditions,
            table=table,
            pods=self.records,
            played_by={pod: r.spare for pod, r in self.records.items() if r.spare},
            spares={
                m.name: f"{self._ready_spares(m.name)}/{self._spares_wanted(m.name)}"
                for m in self.mw.spec.members
                if m.spares
            },
            spare_pool=self.pool,
            spare_serial=self.spare_serial,
            updated=f"{sum(counts[0] for counts in updated.values())}/{len(self.pods)}",
            rollout={m: f"{new}/{total}" for m, (new, total) in updated.items() if new < total},
            rollout_halted=self.halted,
        )

    def _updated(self) -> dict[str, tuple[int, int]]:
        """Per member: its pods not made from an older template (being made counts), and all."""
        counts = {}
        for member in self.mw.spec.members:
            pods = self.mw.pods_of(member.name)
            counts[member.name] = (sum(not self._outdated(p) for p in pods), len(pods))
        return counts

    def _progressing(self, updated: dict[str, tuple[int, int]]) -> Condition | None:
        """While a rollout runs (or one ran before): what it does now."""
        rolling = [m for m, (new, total) in updated.items() if new < total]
        if not rolling and self.previous.condition("Progressing") is None:
            return None
        if not rolling:
            return self._condition("Progressing", False, "RolloutComplete", "every pod is of its member's template")
        halted = [f"{m}: {self.halted[m].reason}" for m in rolling if m in self.halted]
        if halted:
            return self._condition("Progressing", False, "RolloutHalted", "; ".join(halted))
        if self.mw.spec.update_strategy.paused:
            return self._condition("Progressing", False, "RolloutPaused", "spec.updateStrategy.paused is true")
        left = ", ".join(f"{m} {updated[m][0]}/{updated[m][1]}" for m in rolling)
        return self._condition("Progressing", True, "RollingOut", f"pods of the new template: {left}")

    def _condition(self, type_: str, true: bool, reason: str, message: str) -> Condition:
        status: ConditionStatus = "True" if true else "False"
        old = self.previous.condition(type_)
        since = old.last_transition_time if old is not None and old.status == status else self.now
        return Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=since)

    def _requeue_after(self) -> float | None:
        """Until the next backoff ends, or the next join timeout of a world with a silent pod."""
        waits = [(s.restart_at - self.now).total_seconds() for s in self.worlds.values() if s.restart_at]
        for name, state in self.worlds.items():
            deadline = self._join_deadline(name, state)
            if deadline is not None and any(self._silent(pod, name, state.epoch) for pod in state.pods):
                waits.append(max(0.0, (deadline - self.now).total_seconds()))
        return min(waits) if waits else None

    def _event(self, type_: EventType, reason: str, world: str | None, message: str) -> None:
        self.events.append(EmitEvent(type=type_, reason=reason, world=world, message=message))


# Why a pod waits while it simply starts: not worth an Event.
_STARTING = ("not created yet", "Pending", "ContainerCreating", "PodInitializing")


def _worth_telling(reason: str) -> bool:
    return not reason.startswith(_STARTING)


def _overall_phase(phases: Sequence[str]) -> Phase:
    if phases and all(p == "Succeeded" for p in phases):
        return "Succeeded"
    if "Failed" in phases:
        return "Failed" if all(p in ("Failed", "Succeeded") for p in phases) else "Degraded"
    if "Recovering" in phases:
        return "Recovering"
    return "Pending" if "Pending" in phases else "Running"
