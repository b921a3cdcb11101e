"""The warm start's lr schedule: cosine over a fixed budget, or constant until a target loss then a cool-down."""

from __future__ import annotations

import math

import pytest

from stages.models.tiny import _WarmstartSchedule


def _run(schedule: _WarmstartSchedule, losses) -> list[float]:
    factors, it = [], iter(losses)
    while (f := schedule.lr_factor()) is not None:
        factors.append(f)
        schedule.observe(next(it))
    return factors


def test_without_a_target_it_is_the_cosine_schedule_over_max_steps() -> None:
    factors = _run(_WarmstartSchedule(4, None), [1.0] * 10)
    # 0.5 * (1 + cos(pi * s / 4)) for s = 0..3
    assert factors == pytest.approx(
        [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    )


def test_constant_until_the_moving_average_crosses_then_a_linear_cool_down() -> None:
    # loss 1.0 for 100 steps, then 0.0: the EMA (0.95) falls below 0.03 when 0.95^k < 0.03, k = 69
    # (0.95^68 = 0.0306, 0.95^69 = 0.0291), i.e. after step 169; cool-down = max(169 // 5, 50) = 50 steps
    factors = _run(_WarmstartSchedule(1000, 0.03), [1.0] * 100 + [0.0] * 1000)
    assert len(factors) == 169 + 50
    assert factors[:169] == [1.0] * 169
    assert factors[169:] == pytest.approx([1.0 - i / 50 for i in range(50)])


def test_max_steps_bounds_the_run_when_the_target_is_never_reached() -> None:
    assert _run(_WarmstartSchedule(30, 0.03), [1.0] * 100) == [1.0] * 30
