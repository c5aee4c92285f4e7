"""Invariants of the planner over random topologies and random fault sequences (hypothesis):
no healthy world changes epoch, a pod of a healthy world is never restarted, a live member of a
failed world is never replaced unless a peer named it, it stayed silent past the join timeout,
or its world restarts whole (`replace: World`), epochs only grow,
the table matches the status, restarts stay within policy, and re-planning the same observation
changes nothing. Warm spares: a spare plays one member pod of its own member in its life, only a
ready spare is given an identity, a new pod is created only when no ready spare was there, and
the pool refills."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from multiworld_operator.planner import MultiWorldStatus, Observation, Plan, plan
from multiworld_operator.planner.status import UP_PHASES
from multiworld_operator.spec import MultiWorld, limits, parse_duration
from tests.support.planner_sim import Sim, endpoint, make

pytestmark = pytest.mark.quick

# PLANNER_EXAMPLES=3000 for a long hunt; the default keeps the suite quick.
SETTINGS = settings(
    max_examples=int(os.environ.get("PLANNER_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


SMALL_POLICIES = st.fixed_dictionaries(
    {
        "maxRestarts": st.integers(0, 3),
        "window": st.sampled_from(["30s", "5m"]),
        "backoff": st.fixed_dictionaries(
            {"initialDelay": st.sampled_from(["0s", "2s", "7s"]), "maxDelay": st.just("20s")}
        ),
        "replace": st.sampled_from(["Pod", "World"]),
        "joinTimeout": st.sampled_from(["5s", "5m"]),
    }
)


def durations() -> st.SearchStrategy[str]:
    """Any duration the schema admits, its maximum included."""
    seconds = parse_duration(limits.MAX_DURATION)
    return st.one_of(
        st.integers(0, int(seconds)).map(lambda s: f"{s}s"),
        st.sampled_from(["0s", "500ms", "1h30m", limits.MAX_DURATION]),
    )


# Every number and duration over the schema's whole range.
WHOLE_RANGE_POLICIES = st.fixed_dictionaries(
    {
        "maxRestarts": st.integers(0, limits.MAX_RESTARTS),
        "window": durations(),
        "backoff": st.fixed_dictionaries(
            {"initialDelay": durations(), "maxDelay": durations(), "factor": st.floats(1.0, limits.MAX_FACTOR)}
        ),
        "replace": st.sampled_from(["Pod", "World"]),
        "joinTimeout": durations(),
    }
)


@st.composite
def topologies(draw: st.DrawFn, policies: st.SearchStrategy[dict[str, Any]] = SMALL_POLICIES) -> MultiWorld:
    members: list[dict[str, Any]] = [
        {"name": f"m{i}", "replicas": draw(st.integers(1, 2)), "spares": draw(st.integers(0, 2))}
        for i in range(draw(st.integers(2, 4)))
    ]
    names = [m["name"] for m in members]
    worlds: list[dict[str, Any]] = []
    for i in range(draw(st.integers(1, 3))):
        ranks = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
        if sum(m["replicas"] for m in members if m["name"] in ranks) < 2:
            ranks.append(next(n for n in names if n not in ranks))
        worlds.append({"name": f"world{i}", "ranks": ranks, "failurePolicy": draw(policies)})
    for name in names:  # every member must be in some world
        if not any(name in w["ranks"] for w in worlds):
            worlds[draw(st.integers(0, len(worlds) - 1))]["ranks"].append(name)
    return make(members, worlds)


FAULTS = st.one_of(
    st.tuples(st.just("start"), st.floats(0, 1)),
    st.tuples(st.just("fail"), st.integers(0, 7)),
    st.tuples(st.just("vanish"), st.integers(0, 7)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("report"), st.integers(0, 2), st.integers(-1, 0), st.integers(-1, 3)),
    st.tuples(st.just("advance"), st.sampled_from([1, 3, 8, 40, 400])),
    st.tuples(st.just("freeze"), st.integers(0, 7)),
    st.tuples(st.just("suspend"), st.booleans()),
)


def inject(sim: Sim, fault: tuple[Any, ...]) -> tuple[set[str], set[tuple[str, int]]]:
    """Apply one fault; return the pods it hit and the (world, epoch) it reported broken."""
    kind = fault[0]
    pods = sorted(sim.pods)
    if kind == "start":
        if fault[1] > 0.3:
            sim.start_all()
        return set(), set()
    if kind in ("fail", "vanish", "finish", "freeze") and pods:
        pod = pods[fault[1] % len(pods)]
        if kind == "vanish":
            sim.vanish(pod)
        elif kind == "freeze":
            sim.frozen.add(pod)  # Running to the platform; its worker follows no table any more
            return set(), set()
        else:
            sim.set_phase(pod, "Failed" if kind == "fail" else "Succeeded")
        # A pod that ended leaves its worlds (a finished one may be replaced, which moves them).
        return {pod}, set()
    if kind == "report" and sim.status is not None:
        # A worker reports an epoch it held: the current one or an older one, never a future one.
        names = list(sim.status.worlds)
        world = names[fault[1] % len(names)]
        epoch = max(1, sim.epoch(world) + fault[2])
        size = sim.status.worlds[world].size
        sim.report(world, epoch, peer_rank=fault[3] if 0 <= fault[3] < size else None)
        return set(), {(world, epoch)}
    if kind == "advance":
        sim.advance(fault[1])
    if kind == "suspend":
        sim.mw = sim.mw.model_copy(update={"spec": sim.mw.spec.model_copy(update={"suspend": fault[1]})})
        return set(sim.pods), set()  # every world may move
    return set(), set()


def healthy_worlds(sim: Sim, before: MultiWorldStatus, hit: set[str], reported: set[tuple[str, int]]) -> list[str]:
    """Worlds that are up, whose every member runs (none ended earlier, none silent past a join
    timeout of another world), and that nothing hit or reported in this step."""
    return [
        name
        for name, world in before.worlds.items()
        if world.up
        and not hit & {before.played_by_pod(p) for p in world.pods}
        and (name, world.epoch) not in reported
        and all(
            (seen := sim.pods.get(before.played_by_pod(p))) is not None
            and seen.phase in ("Pending", "Running")
            and not silent_too_long(sim, before, p)
            for p in world.pods
        )
    ]


def ours(sim: Sim, before: MultiWorldStatus, pod: str) -> bool:
    """Whether member pod `pod`'s instance (a pod of its name, or the spare playing it) is the
    one the planner asked for."""
    record = before.pods.get(pod)
    seen = sim.pods.get(before.played_by_pod(pod))
    return (
        record is not None
        and seen is not None
        and seen.phase != "Missing"
        and (record.spare is not None or seen.created_for == record.created_for)
    )


def check_step(sim: Sim, before: MultiWorldStatus, result: Plan, hit: set[str], reported: set[tuple[str, int]]) -> None:
    after = result.status
    # Epochs only grow.
    for name, world in before.worlds.items():
        assert after.worlds[name].epoch >= world.epoch, name
    # A published epoch keeps its store's address: its members wait there (a worker ignores a
    # changed entry at the same epoch).
    published = {entry.name: entry for entry in before.table.worlds}
    for entry in result.table.worlds:
        old = published.get(entry.name)
        if old is not None and old.epoch == entry.epoch:
            assert (entry.host, entry.port) == (old.host, old.port), (entry.name, entry.epoch)
    # No healthy world changes epoch, leaves the table, or loses a pod of its own.
    deleted = {d.pod for d in result.deletes}
    for name in healthy_worlds(sim, before, hit, reported):
        assert after.worlds[name].epoch == before.worlds[name].epoch, (name, result.events)
        assert after.worlds[name].up or after.worlds[name].phase == "Succeeded", name
        for pod in before.worlds[name].pods:
            instance = before.played_by_pod(pod)
            assert not (instance in deleted and ours(sim, before, pod)), f"{pod} of healthy {name} restarted"
    check_replacements(sim, before, result)
    check_spares(sim, before, result)
    check_consistency(sim.mw, sim, result)


def check_replacements(sim: Sim, before: MultiWorldStatus, result: Plan) -> None:
    """A live member pod (Running, the instance the planner asked for) is deleted only when a
    peer named it at its world's current epoch, it was silent past a world's join timeout, one
    of its worlds restarts whole (`replace: World`), or no world of it is up any more."""
    deleted = {d.pod for d in result.deletes}
    for pod, record in before.pods.items():
        instance = record.spare or pod
        seen = sim.pods.get(instance)
        if instance not in deleted or seen is None or seen.phase != "Running" or not ours(sim, before, pod):
            continue
        worlds = sim.mw.worlds_of_pod(pod)
        if any(sim.mw.world(w).failure_policy.replace == "World" for w in worlds):
            continue
        if not any(result.status.worlds[w].up for w in worlds) or sim.mw.spec.suspend:
            continue
        named = any(
            r.peer_rank is not None
            and r.world in before.worlds
            and r.epoch == before.worlds[r.world].epoch
            and before.worlds[r.world].pods[r.peer_rank] == pod
            for r in sim.reports
            if r.peer_rank is not None and r.world in before.worlds and r.peer_rank < before.worlds[r.world].size
        )
        assert named or silent_too_long(sim, before, pod), (
            f"live {pod} replaced: {[d.reason for d in result.deletes if d.pod == instance]}"
        )


def silent_too_long(sim: Sim, before: MultiWorldStatus, pod: str) -> bool:
    """Whether member pod `pod` was kept from an earlier epoch of one of its worlds and, that
    world's join timeout after the epoch opened, shows neither joining nor having joined it."""
    record = before.pods.get(pod)
    seen = sim.pods.get(before.played_by_pod(pod))
    if record is None or seen is None or seen.phase != "Running" or seen.joined is None:
        return False
    joined = seen.joined
    return any(
        (state := before.worlds[w]).up
        and state.epoch_started is not None
        and sim.now >= state.epoch_started + timedelta(seconds=sim.mw.world(w).failure_policy.join_timeout_seconds)
        and record.created_for.get(w, 0) < state.epoch
        and state.epoch not in (joined.get(w), seen.joining.get(w))
        for w in sim.mw.worlds_of_pod(pod)
    )


def ready_spares(sim: Sim, before: MultiWorldStatus, member: str) -> set[str]:
    """The spares of `member` the planner could give an identity in this step."""
    return {
        name
        for name, spare in before.spare_pool.items()
        if spare.member == member
        and spare.template == sim.mw.template_digest(member)
        and name in sim.pods
        and sim.pods[name].phase == "Running"
        and sim.pods[name].warm
    }


def check_spares(sim: Sim, before: MultiWorldStatus, result: Plan) -> None:
    assigned = {a.pod: a.plays for a in result.assigns}
    for spare, pod in assigned.items():
        member, _ = sim.mw.member_of_pod(pod)
        assert spare in ready_spares(sim, before, member), f"{spare} given {pod} while not a ready spare of {member}"
        assert result.status.pods[pod].spare == spare
    for create in result.creates:
        asked = before.pods.get(create.pod)
        repeated = asked is not None and not asked.observed and asked.created_for == create.created_for
        if not create.spare and not repeated:
            # A new pod of a member's name only when no ready spare of its member was there.
            assert not ready_spares(sim, before, create.member) - set(assigned), create.pod
    players = [r.spare for r in result.status.pods.values() if r.spare]
    assert len(players) == len(set(players)), "a spare plays two member pods"
    assert not set(players) & set(result.status.spare_pool), "a spare both plays and waits"
    for pod, record in result.status.pods.items():
        if record.spare:
            member, _ = sim.mw.member_of_pod(pod)
            assert record.spare.startswith(f"{sim.mw.name}-{member}-spare-"), (pod, record.spare)


def check_consistency(mw: MultiWorld, sim: Sim, result: Plan) -> None:
    status = result.status
    tabled = {n: w for n, w in status.worlds.items() if w.phase in UP_PHASES}  # backing off included
    assert [(w.name, w.epoch, [w.plays.get(p, p) for p in w.pods]) for w in result.table.worlds] == [
        (n, w.epoch, w.pods) for n, w in tabled.items()
    ]
    up = {n: w for n, w in status.worlds.items() if w.up}
    for entry in result.table.worlds:
        assert entry.pods == [status.played_by_pod(p) for p in status.worlds[entry.name].pods]
    assert status.restarts == sum(w.restarts for w in status.worlds.values())
    running = sum(w.phase == "Running" for w in status.worlds.values())
    assert status.worlds_ready == f"{running}/{len(status.worlds)}"
    present = {name for name, pod in sim.pods.items() if pod.phase != "Missing"}
    for create in result.creates:
        assert create.pod not in present, f"{create.pod} created while it exists"
        if create.spare:
            assert create.pod in status.spare_pool and not create.worlds and not create.created_for
            assert create.template == mw.template_of(create.member)
            continue
        assert set(create.created_for) == set(mw.worlds_of_pod(create.pod))
        assert {a.name: a.epoch for a in create.worlds} == {
            n: w.epoch for n, w in tabled.items() if create.pod in w.pods
        }
        assert any(n in up for n in mw.worlds_of_pod(create.pod)), f"{create.pod} has no world to join"
    for name, world in status.worlds.items():
        policy = mw.world(name).failure_policy
        assert len(world.recent_restarts) <= policy.max_restarts, name


def check_idempotent(sim: Sim, observation: Observation, result: Plan) -> None:
    again = plan(sim.mw, result.status, observation, endpoint=endpoint)
    assert again.status == result.status
    assert again.events == [] and again.publishes == []
    assert {c.pod for c in again.creates} <= {c.pod for c in result.creates}
    assert {d.pod for d in again.deletes} <= {d.pod for d in result.deletes}
    assert again.requeue_after == result.requeue_after


@SETTINGS
@given(mw=topologies(), faults=st.lists(st.tuples(FAULTS, st.booleans()), max_size=25))
def test_invariants_hold_under_random_faults(mw: MultiWorld, faults: list[tuple[tuple[Any, ...], bool]]) -> None:
    sim = Sim(mw)
    sim.step()
    played: dict[str, str] = {}  # spare -> the one member pod it ever played
    for fault, executed in faults:
        hit, reported = inject(sim, fault)
        assert sim.status is not None
        before = sim.status
        observation = sim.observation()
        result = sim.plan()
        check_step(sim, before, result, hit, reported)
        check_idempotent(sim, observation, result)
        for pod, record in result.status.pods.items():
            if record.spare:
                assert played.setdefault(record.spare, pod) == pod, f"{record.spare} played two member pods"
        if executed:
            sim.execute(result)
        else:
            sim.status = result.status  # the platform stored the status but lagged on the pods


@SETTINGS
@given(mw=topologies(WHOLE_RANGE_POLICIES), faults=st.lists(FAULTS, max_size=25))
def test_the_planner_never_raises_over_the_schemas_whole_range(mw: MultiWorld, faults: list[tuple[Any, ...]]) -> None:
    sim = Sim(mw)
    sim.step()
    for fault in faults:
        inject(sim, fault)
        sim.execute(sim.plan())


@SETTINGS
@given(mw=topologies(), faults=st.lists(FAULTS, max_size=15))
def test_every_surviving_world_comes_back(mw: MultiWorld, faults: list[tuple[Any, ...]]) -> None:
    """After any faults, a platform that keeps executing plans gets every world that is not
    Failed or finished back to Running at an epoch it holds on every rank."""
    sim = Sim(mw)
    sim.step()
    for fault in faults:
        if fault[0] not in ("finish", "freeze", "suspend"):  # ends, freezes or stops for good
            inject(sim, fault)
            sim.step()
    for _ in range(12):
        sim.start_all()
        result = sim.step()
        if result.requeue_after:
            sim.advance(result.requeue_after)
    assert sim.status is not None
    for name, world in sim.status.worlds.items():
        assert world.phase in ("Running", "Failed"), (name, world.phase)
        if world.phase == "Running":
            assert world.ready_ranks == world.size
            for pod in world.pods:
                instance = sim.pods[sim.status.played_by_pod(pod)]
                assert instance.joined is not None and instance.joined.get(name) == world.epoch
    # The pools refilled: every member that keeps spares has them all, warm, once its pods run.
    if all(w.phase == "Running" for w in sim.status.worlds.values()):
        for member in mw.spec.members:
            if member.spares:
                assert sim.status.spares[member.name] == f"{member.spares}/{member.spares}", sim.status.spares


@st.composite
def edits(draw: st.DrawFn) -> tuple[MultiWorld, MultiWorld]:
    """A topology and an edit of it: a member resized, a world added, or a world removed."""
    before = draw(topologies())
    members = [m.model_dump(by_alias=True, exclude_none=True) for m in before.spec.members]
    worlds = [w.model_dump(by_alias=True, exclude_none=True) for w in before.spec.worlds]
    change = draw(st.sampled_from(["resize", "add", "remove"]))
    if change == "resize":
        member = draw(st.sampled_from(members))
        member["replicas"] = 3 - member["replicas"]
        for world in worlds:  # keep every world at 2 ranks or more
            if sum(m["replicas"] for m in members if m["name"] in world["ranks"]) < 2:
                member["replicas"] = 2
    elif change == "add":
        members.append({"name": "extra", "replicas": 2})
        worlds.append({"name": "added", "ranks": [draw(st.sampled_from(members[:-1]))["name"], "extra"]})
    elif len(worlds) > 1:
        gone = worlds.pop(draw(st.integers(0, len(worlds) - 1)))
        members = [m for m in members if any(m["name"] in w["ranks"] for w in worlds)]
        del gone
    return before, make(members, worlds)


@SETTINGS
@given(pair=edits())
def test_spec_edits_touch_only_what_changed(pair: tuple[MultiWorld, MultiWorld]) -> None:
    before, after = pair
    sim = Sim(before)
    sim.settle()
    assert sim.status is not None
    old = sim.status
    sim.mw = after
    result = sim.plan()
    kept_pods = set(before.all_pods()) & set(after.all_pods())
    assert not {d.pod for d in result.deletes} & kept_pods
    spares = set(old.spare_pool)
    assert {d.pod for d in result.deletes} - spares == set(before.all_pods()) - set(after.all_pods())
    kept_members = {m.name for m in after.spec.members}
    for delete in result.deletes:  # only the spares of a removed member go with it
        assert delete.pod not in spares or old.spare_pool[delete.pod].member not in kept_members, delete
    # A new member pod is created, or played by a ready spare of its member.
    new_pods = {c.pod for c in result.creates if not c.spare} | {a.plays for a in result.assigns}
    assert new_pods == set(after.all_pods()) - set(before.all_pods())
    for world in after.spec.worlds:
        name = world.name
        if name not in old.worlds:
            assert result.status.worlds[name].epoch == 1
        elif old.worlds[name].pods == after.world_pods(name):
            assert result.status.worlds[name].epoch == old.worlds[name].epoch
            assert result.status.worlds[name].phase == "Running"
        else:
            assert result.status.worlds[name].epoch == old.worlds[name].epoch + 1
    assert result.status.restarts == old.restarts
    check_consistency(after, sim, result)
    check_idempotent(sim, sim.observation(), result)


def edit_templates(sim: Sim, edited: list[int], room: int, surge: int = 1) -> set[str]:
    """Bring the MultiWorld up with every pool full, then give the members `edited` (indexes,
    wrapping) a new template with `maxUnavailable: room` and `maxSurge: surge`; the names of
    those members."""
    for _ in range(4):
        sim.settle()
        sim.start_all()
        sim.step()
    data = sim.mw.model_dump(by_alias=True, exclude_none=True)
    names = [m["name"] for m in data["spec"]["members"]]
    changed = {names[i % len(names)] for i in edited}
    for member in data["spec"]["members"]:
        if member["name"] in changed:
            member["template"] = {"spec": {"containers": [{"name": "c", "image": "new"}]}}
    data["spec"]["updateStrategy"] = {"maxUnavailable": room, "maxSurge": surge}
    sim.mw = MultiWorld.model_validate(data)
    return changed


def rolled_within(result: Plan, room: int) -> None:
    """The plan rolls out at most `room` pods (a PodUpdated Event each: a failure's replacements
    are not the rollout's)."""
    rolled = [e.message for e in result.events if e.reason == "PodUpdated"]
    assert len(rolled) <= room, rolled


@SETTINGS
@given(
    mw=topologies(),
    edited=st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
    room=st.integers(1, 3),
    surge=st.integers(1, 3),
)
def test_a_rollout_replaces_each_old_pod_once_within_its_room_and_restarts_nothing(
    mw: MultiWorld, edited: list[int], room: int, surge: int
) -> None:
    """Any members' templates edited on a running MultiWorld: every pod of an edited member is
    replaced once by one of its new template, never more than `maxUnavailable` pods at a time
    are replaced and never more than `maxSurge` spares start at once, no restart is counted, no
    pod of an unedited member moves, and every world runs again with every pool full and the
    rollout complete."""
    sim = Sim(mw)
    changed = edit_templates(sim, edited, room, surge)
    replaced: list[str] = []
    for _ in range(40):
        result = sim.step()
        rolled_within(result, room)
        # Every pod runs after each step (start_all): what a step creates is all that starts.
        spares = [c.pod for c in result.creates if c.spare]
        assert len(spares) <= surge, spares
        replaced += [d.pod for d in result.deletes if d.reason.startswith("rolling out")]
        replaced += [a.plays for a in result.assigns]
        sim.start_all()
    assert sim.status is not None and sim.status.restarts == 0
    expected = {p for m in changed for p in sim.mw.pods_of(m)}
    assert sorted(replaced) == sorted(expected), (replaced, expected)
    assert sim.status.updated == f"{len(sim.mw.all_pods())}/{len(sim.mw.all_pods())}"
    assert all(w.phase == "Running" for w in sim.status.worlds.values()), sim.status.worlds
    assert all(ready == wanted for ready, wanted in (s.split("/") for s in sim.status.spares.values()))
    progressing = sim.status.condition("Progressing")
    assert progressing is not None and progressing.reason == "RolloutComplete", progressing


@SETTINGS
@given(
    mw=topologies(),
    edited=st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
    room=st.integers(1, 3),
    faults=st.lists(FAULTS.filter(lambda f: f[0] not in ("finish", "freeze", "suspend")), max_size=12),
)
def test_a_rollout_under_random_faults_stays_within_its_room_and_ends(
    mw: MultiWorld, edited: list[int], room: int, faults: list[tuple[Any, ...]]
) -> None:
    """Templates edited on a running MultiWorld while pods fail, vanish and are reported broken
    between the rollout's steps: no step rolls out more than `maxUnavailable` pods, epochs only
    grow, and once the faults stop every world that is not Failed runs again with each edited
    member's pods on its new template, unless a pod of that template failed, which halts the
    member's rollout (its pods then stay as they are)."""
    sim = Sim(mw)
    changed = edit_templates(sim, edited, room)
    for fault in faults:
        inject(sim, fault)
        assert sim.status is not None
        before = {name: w.epoch for name, w in sim.status.worlds.items()}
        result = sim.step()
        rolled_within(result, room)
        assert all(result.status.worlds[name].epoch >= epoch for name, epoch in before.items())
    for _ in range(40):
        sim.start_all()
        result = sim.step()
        rolled_within(result, room)
        if result.requeue_after:
            sim.advance(result.requeue_after)
    status = sim.status
    assert status is not None
    assert all(w.phase in ("Running", "Failed") for w in status.worlds.values()), status.worlds
    if all(w.phase == "Running" for w in status.worlds.values()):
        digests = {m: sim.mw.template_digest(m) for m in changed if m not in status.rollout_halted}
        stale = [
            pod
            for member, digest in digests.items()
            for pod in sim.mw.pods_of(member)
            if status.pods[pod].template != digest
        ]
        assert stale == [], (stale, status.rollout_halted)
