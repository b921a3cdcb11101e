"""The warm start's lr schedule (cosine over a fixed budget, or constant until a target loss then a cool-down),
its examples (each prompt once per answer format) and the loss floor the target is measured above."""

from __future__ import annotations

import math

import pytest

from configs.schema import TinyModelConfig
from stages.models.tiny import _WarmstartSchedule, build_char_tokenizer, response_floor_nats, warmstart_loss_floor


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


def test_the_floor_is_the_entropy_of_the_formats_given_the_prompt() -> None:
    a, b = [1, 2], [3, 4]  # two prompts' ids
    rows = [(a, [5], None), (a, [5], None), (a, [5], None), (a, [6, 7], None), (b, [8], None), (b, [9], [True])]
    floors = response_floor_nats(rows)
    assert floors[:4] == pytest.approx([-math.log(3 / 4)] * 3 + [-math.log(1 / 4)])
    # one text response for b: nothing left to chance; a multi-turn row is not counted at all
    assert floors[4:] == [0.0, 0.0]


def test_each_prompt_gets_every_listed_format_and_the_mix_has_its_floor() -> None:
    import pandas as pd

    from stages.initial_policy import warmstart_examples

    tok = build_char_tokenizer()
    rows = pd.DataFrame(
        {
            "prompt": [[{"role": "user", "content": f"{i}+1="}] for i in range(3)],
            "reward_model": [{"ground_truth": str(i + 1)} for i in range(3)],
            "data_source": ["rlake/arith"] * 3,
            "extra_info": [{}] * 3,
        }
    )
    one = warmstart_examples(TinyModelConfig(), tok, rows)
    assert [r for _, r in one] == ["#### 1", "#### 2", "#### 3"]
    assert warmstart_loss_floor(tok, one) == 0.0
    cfg = TinyModelConfig(warmstart_answer_formats=["{answer}", "{answer}", "{answer}", "#### {answer}"])
    mix = warmstart_examples(cfg, tok, rows)
    assert [r for _, r in mix[:4]] == ["1", "1", "1", "#### 1"] and len(mix) == 12
    # per prompt: 3 x -log(3/4) nats over 3 x 2 tokens ("1" + EOS) and -log(1/4) over 7 ("#### 1" + EOS)
    floor = (3 * -math.log(3 / 4) - math.log(1 / 4)) / (3 * 2 + 7)
    assert warmstart_loss_floor(tok, mix) == pytest.approx(floor)
