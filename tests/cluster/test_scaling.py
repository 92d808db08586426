"""`ScaleAdvisor`: one more worker once a role's pressure has stayed high for `up_delay_s` (and only once
the last one added has joined), one fewer once the others would carry a low pressure for
`down_delay_s`, always within the role's bounds."""

from __future__ import annotations

import pytest

from cluster.scaling import RoleBounds, ScaleAdvisor, ScalingConfig

CFG = ScalingConfig(decode=RoleBounds(1, 3), up_at=0.8, down_at=0.5, up_delay_s=2.0, down_delay_s=10.0)


def decode(advisor: ScaleAdvisor, t: float, current: int, pressure: float) -> int:
    return advisor.advise(t, 1, 0.0, current, pressure).decode


def test_up_after_the_delay_one_at_a_time_and_never_past_the_maximum() -> None:
    a = ScaleAdvisor(CFG)
    assert decode(a, 0.0, 1, 1.5) == 1  # high, but not for long yet
    assert decode(a, 1.9, 1, 1.5) == 1
    assert decode(a, 2.0, 1, 1.5) == 2
    assert decode(a, 5.0, 1, 1.5) == 2  # the second has not joined: no third yet
    assert decode(a, 6.0, 2, 1.5) == 2  # joined: the delay starts again
    assert decode(a, 8.0, 2, 1.5) == 3
    assert decode(a, 20.0, 3, 9.0) == 3  # the maximum


def test_down_after_the_delay_when_the_others_would_carry_it_and_never_below_the_minimum() -> None:
    a = ScaleAdvisor(CFG)
    for t in (0.0, 2.0):
        decode(a, t, 1, 1.0)
    assert decode(a, 3.0, 2, 0.3) == 2  # 0.3 x 2 / 1 = 0.6 > 0.5: one worker would be too busy
    assert decode(a, 4.0, 2, 0.2) == 2  # 0.4: low from now on
    assert decode(a, 13.9, 2, 0.2) == 2
    assert decode(a, 14.0, 2, 0.2) == 1
    assert decode(a, 100.0, 1, 0.0) == 1  # the minimum


def test_a_blip_resets_the_delay() -> None:
    a = ScaleAdvisor(CFG)
    assert decode(a, 0.0, 1, 1.0) == 1
    assert decode(a, 1.5, 1, 0.1) == 1  # fell back: the high run ends
    assert decode(a, 2.5, 1, 1.0) == 1
    assert decode(a, 4.5, 1, 1.0) == 2


def test_before_any_worker_reported_the_minimum_is_advised_and_bounds_are_checked() -> None:
    assert decode(ScaleAdvisor(CFG), 0.0, 0, 5.0) == 1
    assert decode(ScaleAdvisor(CFG), 0.0, 5, 0.9) == 3  # more than the maximum running: advised down to it
    with pytest.raises(ValueError):
        RoleBounds(2, 1)
    with pytest.raises(ValueError):
        ScalingConfig(up_at=0.5, down_at=0.6)


def test_no_scale_down_while_the_worker_last_added_is_still_starting_unless_it_never_joins() -> None:
    a = ScaleAdvisor(ScalingConfig(decode=RoleBounds(1, 3), up_delay_s=2.0, down_delay_s=10.0, join_wait_s=100.0))
    decode(a, 0.0, 1, 1.0)
    assert decode(a, 2.0, 1, 1.0) == 2  # up at 2 s; the replica starts (its node may start first)
    for t in (3.0, 20.0, 60.0):  # the pressure of the one there is low (prefill is the bottleneck, say)
        assert decode(a, t, 1, 0.1) == 2
    assert decode(a, 102.0, 1, 0.1) == 1  # never joined within join_wait_s: the target comes back down
    b = ScaleAdvisor(ScalingConfig(decode=RoleBounds(1, 3), up_delay_s=2.0, down_delay_s=10.0, join_wait_s=100.0))
    decode(b, 0.0, 1, 1.0)
    decode(b, 2.0, 1, 1.0)
    assert decode(b, 30.0, 2, 0.1) == 2  # joined at 30 s: the low spell counts from here
    assert decode(b, 40.0, 2, 0.1) == 1


def test_a_role_with_no_worker_seen_holds_its_target() -> None:
    a = ScaleAdvisor(CFG)
    for t in (0.0, 2.0):
        decode(a, t, 1, 1.0)
    assert decode(a, 3.0, 2, 1.0) == 2
    for t in (4.0, 10.0, 20.0, 40.0):  # every decode worker reads down: pressure 0 says nothing
        assert decode(a, t, 0, 0.0) == 2
    assert decode(a, 41.0, 2, 0.1) == 2  # seen again and low: the delay starts now, not at 4.0
    assert decode(a, 50.9, 2, 0.1) == 2
    assert decode(a, 51.0, 2, 0.1) == 1
