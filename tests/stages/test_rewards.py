"""Reward functions against hand-worked cases (verl gsm8k / MATH / DAPO semantics), data_source routing
as verl's default_compute_score, and the reward stage. The MATH answer forms are in test_math_scorer.py."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from configs.schema import RewardConfig
from stages.data.math_grader import RewardTimeout
from stages.data.rewards import (
    REWARD_FNS,
    extract_gsm8k_answer,
    last_boxed,
    reward_fn_for,
    score_gsm8k,
    score_math,
    score_math_dapo,
)
from stages.scored_rollouts import RewardStage, score_rollouts


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
        ("a, b", ",", 1.0),  # ',' alone matches the number regex and is not skipped (verl)
        ("no digits here", "0", 0.0),
    ],
)
def test_gsm8k_flexible_cases(text: str, gt: str, expected: float) -> None:
    assert score_gsm8k(text, gt, method="flexible") == expected


def test_gsm8k_flexible_only_dots_returns_a_dot() -> None:
    # every match is ".": verl's loop over the matches ends on the first one, ".", which is an
    # extracted (wrong) answer and earns format_score; no match at all is None and earns 0
    assert extract_gsm8k_answer("the end. Really.", "flexible") == "."
    assert score_gsm8k("the end. Really.", "5", method="flexible", format_score=0.1) == 0.1
    assert extract_gsm8k_answer("no digits here", "flexible") is None


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
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),  # dfrac -> frac; \frac12 -> \frac{1}{2} (verl's fix_fracs)
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


@pytest.mark.parametrize(
    "text,gt,expected",
    [
        ("so Answer: 42", "42", 1.0),  # Minerva "Answer:" line, normalised both sides
        ("so Answer: 41", "42", -1.0),  # wrong is -1, not 0
        ("ANSWER : 1,000", "1000", 1.0),  # case-insensitive; commas dropped from a plain integer
        ("Answer: x = 5 units", "5", 1.0),  # right of the last '=', 'units' removed, spaces removed
        ("Answer: $\\frac12$.", "\\frac{1}{2}", 1.0),  # the first $...$ kept (the trailing '.' dropped), \fracab braced
        ("Answer: 41 then \\boxed{42}", "42", -1.0),  # an Answer: line wins over a box
        ("so \\boxed{42}", "42", 1.0),  # no Answer: line -> the last \boxed{} of the final 100 chars
        ("so \\boxed{ 42}", "42", -1.0),  # the box fallback compares raw strings
        ("\\boxed{42}" + "." * 150, "42", -1.0),  # the box is not in the final 100 characters
        ("Answer: 42" + "." * 300, "42", -1.0),  # only the final 300 characters are read
        ("no answer at all", "42", -1.0),
    ],
)
def test_math_dapo_cases(text: str, gt: str, expected: float) -> None:
    out = score_math_dapo(text, gt)
    assert out["score"] == expected and out["acc"] is (expected == 1.0)
    assert score_math_dapo(text, gt, format_score=0.5, score=2.0)["score"] == expected  # both ignored: DAPO is +-1


@pytest.mark.parametrize(
    "text,pred",
    [
        ("Answer: x = 5 units", "5"),  # the normalized Answer: text
        ("so \\boxed{ 42}", " 42"),  # no Answer: line: the boxed answer as written
        ("no answer at all", "[INVALID]"),
    ],
)
def test_math_dapo_returns_score_acc_pred_as_verl(text: str, pred: str) -> None:
    # verl's math_dapo.compute_score returns {"score", "acc", "pred"}; acc and pred become scored_rollouts columns
    assert score_math_dapo(text, "42")["pred"] == pred
    out = RewardStage()(_rollouts([text], ["math_dapo"]))
    assert out["pred"].tolist() == [pred] and out["reward_extra_keys"].tolist() == [["acc", "pred"]]


@pytest.mark.parametrize(
    "source,fn",
    [
        ("openai/gsm8k", score_gsm8k),
        ("lighteval/MATH", score_math),
        ("DigitalLearningGmbH/MATH-lighteval", score_math),
        ("HuggingFaceH4/MATH-500", score_math),
        ("math_dapo", score_math_dapo),
        ("math", score_math_dapo),  # verl routes "math" to its DAPO scorer
        ("math_dapo_reasoning", score_math_dapo),
        ("aime", score_math_dapo),  # any name starting with "aime"
        ("aime2024", score_math_dapo),
        ("aime_2025_I", score_math_dapo),
        ("gsm8k", score_gsm8k),  # rlake's alias, unknown to verl
        ("rlake/arith", score_gsm8k),
        ("rlake/gsm8k_synth", score_gsm8k),
    ],
)
def test_routing_follows_verl_default_compute_score(source: str, fn) -> None:
    assert reward_fn_for(source) is fn


def test_math_source_scores_as_dapo() -> None:
    assert reward_fn_for("math")("Answer: 7", "7")["score"] == 1.0
    assert reward_fn_for("math")("\\boxed{8}", "7")["score"] == -1.0


@pytest.mark.parametrize(
    "source,module",
    [
        ("numina_olympiads", "prime_math"),
        ("numina_cn_k12", "prime_math"),
        ("codecontests", "sandbox_fusion or prime_code"),
        ("taco", "sandbox_fusion or prime_code"),
        ("hiyouga/geometry3k", "geo3k"),
        ("searchR1_nq", "search_r1_like_qa_em"),
        ("searchR1_2wikimultihopqa", "search_r1_like_qa_em"),
    ],
)
def test_verl_sources_rlake_does_not_score_say_so(source: str, module: str) -> None:
    with pytest.raises(ValueError, match=rf"'{source}' is scored in verl by verl.utils.reward_score.{module}") as err:
        reward_fn_for(source)
    assert "rlake does not implement; register a scorer for it (stages.data.rewards.REWARD_FNS" in str(err.value)
    assert "reward.custom_reward_function.path" in str(err.value)


def test_unknown_data_source_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"No reward function for data_source 'foo/bar'. Known: \[") as err:
        reward_fn_for("foo/bar")
    assert "openai/gsm8k" in str(err.value) and "any name starting with ['aime']" in str(err.value)


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
    with pytest.raises(ValueError, match=r"failed on rollout 1 \(data_source 'test/broken'\): raised at \S+:\d+: Runt"):
        RewardStage(on_error="raise")(df)
    out = RewardStage(on_error="flag")(df)
    assert out["reward"].iloc[0] == 1.0 and math.isnan(out["reward"].iloc[1]) and math.isnan(out["reward"].iloc[2])
    assert out["reward_error"].iloc[1] == "RuntimeError: parser crashed"
    assert "non-finite" in out["reward_error"].iloc[2]
    assert len(out) == 3  # no row lost


def test_a_timed_out_row_scores_zero_and_is_flagged(monkeypatch) -> None:
    def slow(text, gt, **kw):
        if text == "slow":
            raise RewardTimeout("_verify_pair ran over 30 s; its process was killed")
        return 1.0

    monkeypatch.setitem(REWARD_FNS, "test/slow", slow)
    df = _rollouts(["ok", "slow", "ok"], ["test/slow"] * 3)
    for on_error in ("raise", "flag"):  # never raised: verl's timeout_score is 0
        out = RewardStage(on_error=on_error)(df)
        assert out["reward"].tolist() == [1.0, 0.0, 1.0]
        assert out["reward_error"].iloc[1] == "RewardTimeout: _verify_pair ran over 30 s; its process was killed"
        assert out["reward_error"].iloc[[0, 2]].isna().all()


@pytest.mark.ray
def test_score_rollouts_through_ray_tasks(ray_session) -> None:
    df = _rollouts([f"#### {i % 7}" for i in range(20)])
    out = score_rollouts(df, RewardConfig(num_workers=2))
    assert out["rollout_id"].tolist() == list(range(20))
    assert out["reward"].tolist() == [1.0 if i % 7 == 5 else 0.0 for i in range(20)]
