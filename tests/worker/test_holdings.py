"""`Holdings`, the one owner of what a WorldManager holds, as a pure state object: random
sequences of its transitions (start joining, install, retry, give up, call off, forget, close,
a spare's identity) and of worlds breaking on their own, legal and illegal, against a model
(hypothesis's stateful testing). After each step the rules of holdings.py hold: one join in
flight per world, never finished nor called off; a world held beside its join is broken and
older; `joined_at` names exactly the worlds held; a closed manager holds nothing and stays
closed; a waiting spare plays no pod and, once identified, never waits again; the epoch given
up per world only grows. A transition that would break a rule raises `RuleBroken` and changes
nothing. The tests after the machine pin each rule once, by hand. No torch, no process: the
worlds are stand-ins with an assignment and `broken`. HOLDINGS_EXAMPLES=2000 for a long hunt."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, cast

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from multiworld.contract import WorldAssignment
from multiworld.membership.holdings import Holdings, Join, RuleBroken

if TYPE_CHECKING:
    from collections.abc import Callable

    from multiworld.world.core import World

pytestmark = pytest.mark.quick

NAMES = ("a", "b")
EPOCHS = st.integers(1, 3)
# A join that ended (a late thread finishing a stale join) one time in four, else one in flight.
STALE = st.sampled_from([False, False, False, True])
WHEN = datetime(2025, 1, 1, tzinfo=UTC)


def assignment(name: str, epoch: int) -> WorldAssignment:
    return WorldAssignment(name=name, rank=0, size=2, host="h", port=29500, epoch=epoch)


class StandIn:
    """What Holdings reads of a world: its assignment and whether it broke."""

    def __init__(self, a: WorldAssignment, *, broken: bool = False) -> None:
        self.assignment = a
        self.broken = broken


def world(name: str, epoch: int, *, broken: bool = False) -> World:
    return cast("World", StandIn(assignment(name, epoch), broken=broken))


def stand_in(w: World) -> StandIn:
    return cast(StandIn, w)


class HoldingsMachine(RuleBasedStateMachine):
    """Drives one Holdings as the manager's parts do, and also as no part may (each such call
    must raise RuleBroken and change nothing), against a model of what it should hold."""

    def __init__(self) -> None:
        super().__init__()
        self.held = Holdings(spare=False)
        self.worlds: dict[str, World] = {}
        self.joined_at: dict[str, datetime] = {}
        self.joins: dict[str, Join] = {}
        self.given_up: dict[str, int] = {}
        self.closed = False
        self.waiting = False
        self.plays = ""
        self.ended: list[Join] = []  # joins no longer in flight (installed, called off, ...)
        self.clock = 0

    @initialize(spare=st.booleans())
    def start(self, spare: bool) -> None:
        self.held = Holdings(spare=spare)
        self.waiting = spare

    # -- the transitions, as the parts call them -------------------------------------------

    @rule(name=st.sampled_from(NAMES), epoch=EPOCHS, close_first=st.booleans())
    def start_joining(self, name: str, epoch: int, close_first: bool) -> None:
        """Joiner.start's last step; `close_first`: the caller closed a world held first, as
        Joiner.start does (when False, a healthy world held is left as it is: a bug)."""
        held_world = self.worlds.get(name)
        if close_first and held_world is not None:
            stand_in(held_world).broken = True
        join = Join(assignment(name, epoch))
        legal = (
            not self.closed
            and name not in self.joins
            and (held_world is None or (held_world.broken and held_world.assignment.epoch < epoch))
        )
        if self.refused_unless(legal, lambda: self.held.start_joining(join)):
            self.joins[name] = join

    @precondition(lambda self: bool(self.joins or self.ended))
    @rule(data=st.data(), stale=STALE, broken=st.booleans())
    def install(self, data: st.DataObject, stale: bool, broken: bool) -> None:
        """Joiner._install: a join's world was formed (perhaps broken already); held only when
        the join is still the one in flight."""
        join = self.pick_join(data, stale)
        a = join.assignment
        formed = world(a.name, a.epoch, broken=broken)
        self.clock += 1
        now = WHEN + timedelta(seconds=self.clock)
        current = self.joins.get(a.name) is join
        assert self.held.install(join, formed, now) is current
        if current:
            del self.joins[a.name]
            self.worlds[a.name] = formed
            self.joined_at[a.name] = now
            assert join.world is formed
            self.end(join)

    @precondition(lambda self: bool(self.joins or self.ended))
    @rule(data=st.data(), stale=STALE, another=st.sampled_from([False, False, False, True]))
    def retry(self, data: st.DataObject, stale: bool, another: bool) -> None:
        """Joiner._failed, following a table: a join in flight tries again (`another`: as a
        join of another epoch, never legal)."""
        join = self.pick_join(data, stale)
        a = join.assignment
        again = Join(assignment(a.name, a.epoch + 1) if another else a, pause=0.5)
        current = self.joins.get(a.name) is join
        if self.refused_unless(current and not another, lambda: self.held.retry(join, again)):
            self.joins[a.name] = again
            self.end(join)

    @precondition(lambda self: bool(self.joins or self.ended))
    @rule(data=st.data(), stale=STALE)
    def give_up(self, data: st.DataObject, stale: bool) -> None:
        """Joiner._failed: a join in flight failed for good."""
        join = self.pick_join(data, stale)
        a = join.assignment
        current = self.joins.get(a.name) is join
        if self.refused_unless(current, lambda: self.held.give_up(join)):
            del self.joins[a.name]
            self.given_up[a.name] = max(self.given_up.get(a.name, 0), a.epoch)
            self.end(join)

    @rule(name=st.sampled_from(NAMES))
    def call_off(self, name: str) -> None:
        """Joiner.start: a newer epoch calls the join in flight off."""
        expected = self.joins.pop(name, None)
        assert self.held.call_off(name) is expected
        if expected is not None:
            assert expected.cancelled.is_set()
            self.ended.append(expected)

    @rule(name=st.sampled_from(NAMES))
    def forget(self, name: str) -> None:
        """WorldManager's leave (and the table's)."""
        join = self.joins.pop(name, None)
        expected = self.worlds.pop(name, None)
        self.joined_at.pop(name, None)
        assert self.held.forget(name) is expected
        if join is not None:
            assert join.cancelled.is_set()
            self.ended.append(join)

    @rule(now=st.integers(0, 3))
    def close(self, now: int) -> None:
        """WorldManager.close; one time in four (a closed manager does nothing more)."""
        if now:
            return
        dropped = self.held.close()
        if self.closed:
            assert dropped is None
            return
        assert dropped is not None
        worlds, joins = dropped
        assert {w.assignment.name: w for w in worlds} == self.worlds
        assert {j.assignment.name: j for j in joins} == self.joins
        for join in joins:  # WorldManager.close calls them off outside the lock
            join.cancelled.set()
        self.ended += joins
        self.worlds.clear()
        self.joined_at.clear()
        self.joins.clear()
        self.closed = True

    @rule(plays=st.sampled_from(["", "member-1"]))
    def identify(self, plays: str) -> None:
        """TableFollower.apply: a table names a waiting spare's pod."""
        if self.refused_unless(self.waiting, lambda: self.held.identify(plays)):
            self.waiting = False
            self.plays = plays

    @precondition(lambda self: bool(self.worlds))
    @rule(data=st.data())
    def world_breaks(self, data: st.DataObject) -> None:
        """A held world breaks on its own (a peer died): no transition of Holdings."""
        name = data.draw(st.sampled_from(sorted(self.worlds)))
        stand_in(self.worlds[name]).broken = True

    # -- helpers ---------------------------------------------------------------------------

    def pick_join(self, data: st.DataObject, stale: bool) -> Join:
        """A join that ended (`stale`, or none is in flight), else one in flight."""
        pool = self.ended if (stale and self.ended) or not self.joins else list(self.joins.values())
        return data.draw(st.sampled_from(pool))

    def end(self, join: Join) -> None:
        join.done.set()  # as the join's thread does once Holdings let it go
        self.ended.append(join)

    def refused_unless(self, legal: bool, transition: Callable[[], object]) -> bool:
        """Run `transition`: it must succeed when `legal`, else raise RuleBroken and change
        nothing. Returns `legal`."""
        if legal:
            transition()
            return True
        before = self.snapshot()
        with pytest.raises(RuleBroken):
            transition()
        assert self.snapshot() == before
        return False

    def snapshot(self) -> tuple[object, ...]:
        held = self.held
        return (
            held.worlds(),
            held.joins(),
            {n: held.joined_at(n) for n in held.worlds()},
            {n: held.given_up_epoch(n) for n in NAMES},
            held.closed,
            held.waiting,
            held.plays,
        )

    # -- the rules, after every step -------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        held = self.held
        assert held.worlds() == self.worlds
        assert held.joins() == self.joins
        assert held.names() == set(self.worlds) | set(self.joins)
        assert held.closed == self.closed
        assert held.waiting == self.waiting
        assert held.plays == self.plays
        for name in NAMES:
            assert held.world(name) is self.worlds.get(name)
            assert held.joining(name) is self.joins.get(name)
            assert held.given_up_epoch(name) == self.given_up.get(name, 0)
            latest = self.joins[name].assignment if name in self.joins else None
            if latest is None and name in self.worlds:
                latest = self.worlds[name].assignment
            assert held.latest(name) == latest

    @invariant()
    def one_join_in_flight_per_world_never_finished_nor_called_off(self) -> None:
        for name, join in self.held.joins().items():
            assert join.assignment.name == name
            assert not join.done.is_set()
            assert not join.cancelled.is_set()

    @invariant()
    def a_world_held_beside_its_join_is_broken_and_older(self) -> None:
        joins = self.held.joins()
        for name, w in self.held.worlds().items():
            assert w.assignment.name == name
            if name in joins:
                assert w.broken
                assert w.assignment.epoch < joins[name].assignment.epoch

    @invariant()
    def joined_at_names_exactly_the_worlds_held(self) -> None:
        held = self.held
        for name in NAMES:
            if held.world(name) is not None:
                assert held.joined_at(name) == self.joined_at[name]
            else:
                with pytest.raises(KeyError):
                    held.joined_at(name)

    @invariant()
    def a_closed_manager_holds_nothing_and_refuses_joins(self) -> None:
        if self.held.closed:
            assert not self.held.names()
            with pytest.raises(RuntimeError, match="closed"):
                self.held.check_open()
        else:
            self.held.check_open()

    @invariant()
    def a_waiting_spare_plays_no_pod(self) -> None:
        if self.held.waiting:
            assert self.held.plays == ""


TestHoldingsRules = HoldingsMachine.TestCase
TestHoldingsRules.settings = settings(
    max_examples=int(os.environ.get("HOLDINGS_EXAMPLES", "150")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_newer_epoch_is_joined_beside_the_broken_world_it_replaces() -> None:
    """The usual life of a world: joined, broken, its next epoch joined beside it, installed in
    its place."""
    held = Holdings(spare=False)
    first = Join(assignment("a", 1))
    held.start_joining(first)
    old = world("a", 1)
    assert held.install(first, old, WHEN)
    assert held.joined_at("a") == WHEN
    second = Join(assignment("a", 2))
    with pytest.raises(RuleBroken, match="healthy"):
        held.start_joining(second)  # the caller closes the world first
    stand_in(old).broken = True
    with pytest.raises(RuleBroken, match="broken"):
        held.start_joining(Join(assignment("a", 1)))  # an epoch no newer than the world held
    held.start_joining(second)
    assert held.world("a") is old and held.joining("a") is second
    assert held.latest("a") == assignment("a", 2)
    new = world("a", 2)
    assert held.install(second, new)
    assert held.worlds() == {"a": new} and held.joins() == {}
    assert not held.install(first, world("a", 1))  # a stale join's world is not held
    stand_in(new).broken = True
    third = Join(assignment("a", 3))
    held.start_joining(third)
    assert held.call_off("a") is third and third.cancelled.is_set()
    assert held.joins() == {} and held.world("a") is new


def test_forget_and_close_drop_joined_at_with_the_world() -> None:
    held = Holdings(spare=True)
    join = Join(assignment("a", 1))
    held.start_joining(join)
    assert held.install(join, world("a", 1), WHEN)
    assert held.forget("a") is not None
    with pytest.raises(KeyError):
        held.joined_at("a")
    held.identify("member-1")
    assert (held.waiting, held.plays) == (False, "member-1")
    with pytest.raises(RuleBroken):
        held.identify("member-2")
    kept = world("b", 1)
    joins = [Join(assignment("b", 1)), Join(assignment("c", 2))]
    for join in joins:
        held.start_joining(join)
    assert held.install(joins[0], kept, WHEN)
    assert held.close() == ([kept], [joins[1]])
    assert held.names() == set()
    with pytest.raises(KeyError):
        held.joined_at("b")
    assert held.close() is None
    with pytest.raises(RuleBroken, match="closed"):
        held.start_joining(Join(assignment("b", 2)))


def test_the_epoch_given_up_only_grows() -> None:
    """A join of an older epoch that fails after a newer one did (a program's own join) leaves
    the newer epoch given up: the table does not try it again."""
    held = Holdings(spare=False)
    for epoch in (3, 1):
        join = Join(assignment("a", epoch))
        held.start_joining(join)
        held.give_up(join)
        assert held.given_up_epoch("a") == 3
        assert held.joining("a") is None
    stale = Join(assignment("a", 4))
    with pytest.raises(RuleBroken, match="not in flight"):
        held.give_up(stale)
