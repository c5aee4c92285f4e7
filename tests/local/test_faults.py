import random

import pytest

from multiworld_operator.local.faults import FaultSchedule, Kill, parse_target, planned_kills

pytestmark = pytest.mark.quick


def test_kill_targets_parse_member_and_ordinal():
    assert parse_target("w1") == ("w1", None)
    assert parse_target("w1:2") == ("w1", 2)
    with pytest.raises(ValueError, match="ORDINAL"):
        parse_target("w1:x")
    with pytest.raises(ValueError, match="MEMBER"):
        parse_target(":1")


def test_kills_pair_with_afters_in_order():
    kills = planned_kills(["w1:1", "leader"], [5, 2])
    assert kills == [Kill(5, "w1", 1), Kill(2, "leader", None)]
    with pytest.raises(ValueError, match="one --after SECONDS per --kill"):
        planned_kills(["w1"], [])
    with pytest.raises(ValueError, match="--after must be >= 0"):
        planned_kills(["w1"], [-1])


def test_schedule_releases_kills_in_time_order():
    schedule = FaultSchedule(planned_kills(["a", "b"], [3, 1]), 0, ["a", "b"], random.Random(1))
    assert schedule.next_at() == 1
    assert schedule.due(0.5) == []
    assert [k.member for k in schedule.due(3)] == ["b", "a"]
    assert schedule.next_at() is None


def test_chaos_rate_is_roughly_kept_and_targets_members():
    schedule = FaultSchedule([], 60, ["a", "b"], random.Random(7))
    kills = schedule.due(600)  # 10 minutes at 60/min: about 600 kills
    assert 450 < len(kills) < 750
    assert {k.member for k in kills} == {"a", "b"}
    assert all(x.at <= y.at for x, y in zip(kills, kills[1:], strict=False))
    with pytest.raises(ValueError, match="--chaos"):
        FaultSchedule([], -1, ["a"], random.Random())
