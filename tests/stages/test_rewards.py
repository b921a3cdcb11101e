"""Reward functions against hand-worked cases (verl gsm8k / MATH semantics) and the reward stage."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from configs.schema import RewardConfig
from stages.data.rewards import REWARD_FNS, extract_gsm8k_answer, last_boxed, reward_fn_for, score_gsm8k, score_math
from stages.reward import RewardStage, score_rollouts


@pytest.mark.parametrize(
    "text,gt,expected",
    [
        ("so the answer is #### 42", "42", 1.0),
        ("#### 1,234", "1234", 1.0),  # commas stripped
        ("#### $17", "17", 0.0),  # verl's regex wants a sign or digit right after '#### '
        ("#### 17$", "17", 1.0),  # a '$' after the number is not part of the match
        ("#### 3 then #### 5", "5", 1.0),  # the LAST #### counts
        ("#### 3 then #### 5", "3", 0.0),
        ("the answer is 42", "42", 0.0),  # no #### -> 0 even if correct
        ("#### -7", "-7", 1.0),
        ("#### 42", "42.0", 0.0),  # exact string compare, as verl
    ],
)
def test_gsm8k_cases(text: str, gt: str, expected: float) -> None:
    assert score_gsm8k(text, gt) == expected


@pytest.mark.parametrize(
    "text,gt,expected",
    [
        ("so she has 18 apples", "18", 1.0),  # no '####' needed
        ("3 + 4 = 7, so 7 + 11 = 18", "18", 1.0),  # the LAST number counts
        ("3 + 4 = 7, so 7 + 11 = 18", "7", 0.0),
        ("she has 18.", "18", 0.0),  # '18.' is one match and is not '.'-stripped (verl)
        ("#### 1,234", "1234", 0.0),  # flexible keeps commas (verl)
        ("total -5 . .", "-5", 1.0),  # a lone '.' is skipped
        ("no digits here", "0", 0.0),
    ],
)
def test_gsm8k_flexible_cases(text: str, gt: str, expected: float) -> None:
    assert score_gsm8k(text, gt, method="flexible") == expected


def test_gsm8k_flexible_reads_last_300_chars_and_gives_format_score() -> None:
    assert score_gsm8k("42" + "x" * 300, "42", method="flexible") == 0.0
    assert score_gsm8k("about 41 of them", "42", method="flexible", format_score=0.1) == 0.1


def test_gsm8k_unknown_method_says_which_are_valid() -> None:
    with pytest.raises(ValueError, match=r"'lenient' is not one of \('strict', 'flexible'\); set reward.gsm8k_method"):
        score_gsm8k("#### 1", "1", method="lenient")


def test_reward_stage_passes_gsm8k_method_to_gsm8k_scorers_only(monkeypatch) -> None:
    texts = ["#### 5", "it is 5", "4"]
    assert RewardStage()(_rollouts(texts))["reward"].tolist() == [1.0, 0.0, 0.0]
    scored = score_rollouts(_rollouts(texts), RewardConfig(gsm8k_method="flexible"), use_ray=False)
    assert scored["reward"].tolist() == [1.0, 1.0, 0.0]
    monkeypatch.setitem(REWARD_FNS, "test/plain", lambda text, gt, **kw: float("method" not in kw))
    plain = RewardStage(gsm8k_method="flexible")(_rollouts(texts, ["test/plain"] * 3))
    assert plain["reward"].tolist() == [1.0, 1.0, 1.0]  # a scorer without a `method` parameter never gets one


def test_gsm8k_only_reads_last_300_chars() -> None:
    text = "#### 42" + "x" * 300
    assert extract_gsm8k_answer(text) is None and score_gsm8k(text, "42") == 0.0


def test_gsm8k_format_score() -> None:
    assert score_gsm8k("#### 41", "42", format_score=0.1) == 0.1
    assert score_gsm8k("41", "42", format_score=0.1) == 0.0


@pytest.mark.parametrize(
    "text,gt,expected",
    [
        ("thus \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 0.0),  # no frac-shorthand normalisation
        ("\\boxed{1} and finally \\boxed{ 2 }", "2", 1.0),  # the last box, spaces removed
        ("\\boxed{\\left( 3 \\right)}", "(3)", 1.0),
        ("no box, 2", "2", 0.0),
    ],
)
def test_math_cases(text: str, gt: str, expected: float) -> None:
    assert score_math(text, gt) == expected


def test_last_boxed_balances_braces() -> None:
    assert last_boxed("\\boxed{a{b}c}") == "a{b}c"
    assert last_boxed("\\boxed{unclosed") is None


def test_unknown_data_source_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"No reward function for data_source 'foo/bar'. Known: \[") as err:
        reward_fn_for("foo/bar")
    assert "openai/gsm8k" in str(err.value)


def _rollouts(texts: list[str], sources: list[str] | None = None) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "rollout_id": range(len(texts)),
            "data_source": sources or ["rlake/arith"] * len(texts),
            "response_text": texts,
            "ground_truth": ["5"] * len(texts),
        }
    )


def test_reward_stage_on_a_batch() -> None:
    out = RewardStage()(_rollouts(["#### 5", "#### 4", "5", "#### 5"]))
    assert out["reward"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out["reward_error"].isna().all()
    assert set(out["reward_fn"]) == {"stages.data.rewards.score_gsm8k"}


def test_raising_reward_fn_names_the_row_or_is_flagged(monkeypatch) -> None:
    def broken(text, gt, **kw):
        if text == "boom":
            raise RuntimeError("parser crashed")
        return float("nan") if text == "nan" else 1.0

    monkeypatch.setitem(REWARD_FNS, "test/broken", broken)
    df = _rollouts(["ok", "boom", "nan"], ["test/broken"] * 3)
    with pytest.raises(ValueError, match="failed on rollout 1: parser crashed"):
        RewardStage(on_error="raise")(df)
    out = RewardStage(on_error="flag")(df)
    assert out["reward"].iloc[0] == 1.0 and math.isnan(out["reward"].iloc[1]) and math.isnan(out["reward"].iloc[2])
    assert out["reward_error"].iloc[1] == "RuntimeError: parser crashed"
    assert "non-finite" in out["reward_error"].iloc[2]
    assert len(out) == 3  # no row lost


@pytest.mark.ray
def test_score_rollouts_through_ray_tasks(ray_session) -> None:
    df = _rollouts([f"#### {i % 7}" for i in range(20)])
    out = score_rollouts(df, RewardConfig(num_workers=2))
    assert out["rollout_id"].tolist() == list(range(20))
    assert out["reward"].tolist() == [1.0 if i % 7 == 5 else 0.0 for i in range(20)]
