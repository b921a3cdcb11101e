"""The generative judge's pure parts: verdict parsing, prompt filling, combining with the rule reward, and
the config checks (what / why / fix). The judge through real engines is in tests/e2e/test_rescore.py."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from configs.schema import JudgeConfig, load_config
from stages.iteration_metrics import model_reward_metrics
from stages.judgements import combine_judge_scores, judge_prompt_texts, parse_verdict, questions_of
from stages.run.preflight import preflight

REGEX = JudgeConfig().score_regex


@pytest.mark.parametrize(
    ("verdict", "score", "error"),
    [
        ("Score: 1", 1.0, None),
        ("The answer is wrong. Score: 0", 0.0, None),
        ("Score:0.75 because", 0.75, None),  # \s* allows no space; the group takes the decimals
        ("Score: -2", -2.0, None),
        ("Score: 1 ... Score: 0", 1.0, None),  # the first match counts
        ("score: 1", None, "does not match"),  # case-sensitive, as written
        ("I cannot grade this.", None, "does not match"),
        ("", None, "does not match"),
    ],
)
def test_parse_verdict(verdict: str, score: float | None, error: str | None) -> None:
    got, why = parse_verdict(verdict, REGEX)
    assert got == score
    assert (why is None) if error is None else (error in why)


def test_a_match_that_is_not_a_number_is_flagged() -> None:
    score, why = parse_verdict("Verdict: yes", r"Verdict: (\w+)")
    assert score is None and "'yes', which is not a number" in why
    score, why = parse_verdict("Verdict: inf", r"Verdict: (\w+)")
    assert score is None and "not finite" in why


def test_prompt_filled_per_row_and_questions_from_the_user_message() -> None:
    rollouts = pd.DataFrame(
        {
            "rollout_id": [0, 1],
            "prompt_id": [5, 9],
            "prompt_text": ["<|user|>2+2=<|assistant|>", "<|user|>7+1=<|assistant|>"],
            "response_text": ["#### 4", "#### 9"],
            "ground_truth": ["4", "8"],
        }
    )
    prompts = pd.DataFrame(
        {
            "prompt_id": [5],  # prompt 9 is missing: its chat-templated prompt_text is used
            "prompt": [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]],
        }
    )
    q = questions_of(rollouts, prompts)
    assert q.tolist() == ["2+2=", "<|user|>7+1=<|assistant|>"]
    texts = judge_prompt_texts(rollouts.assign(question=q), "Q={question} A={response} R={ground_truth} {{ok}}")
    assert texts == ["Q=2+2= A=#### 4 R=4 {ok}", "Q=<|user|>7+1=<|assistant|> A=#### 9 R=8 {ok}"]


def test_combine_replace_and_add_by_hand() -> None:
    scored = pd.DataFrame(
        {
            "rollout_id": [2, 0, 1],
            "reward": [1.0, 0.1, np.nan],  # rule score + overlong penalty; row 1's rule function failed (flagged)
            "score": [1.0, 0.1, np.nan],
            "overlong_penalty": [0.0, -0.5, 0.0],
        }
    )
    judged = pd.DataFrame(
        {"rollout_id": [0, 1, 2], "judge_score": [0.5, 2.0, np.nan], "judge_error": [None, None, "no match"]}
    )
    # replace: judge_score + overlong_penalty; the unparsed row 2 gets 0 + 0
    rep = combine_judge_scores(scored, judged, "replace")
    assert rep["reward"].tolist() == [0.0, 0.5 - 0.5, 2.0]
    # add: rule reward + judge_score; row 2 adds nothing (1.0), the flagged NaN stays NaN
    add = combine_judge_scores(scored, judged, "add")
    assert add["reward"].tolist()[:2] == [1.0, 0.1 + 0.5] and np.isnan(add["reward"].iloc[2])
    assert add["judge_error"].tolist() == ["no match", None, None] and add["score"].equals(scored["score"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("reward.judge.enable=true", "needs reward.judge.model_path"),
        ("reward.judge.prompt_template='Grade {question}'", "{response} is missing"),
        ("reward.judge.prompt_template='{response} vs {answer}'", "['answer'] are unknown"),
        ("reward.judge.score_regex='Score'", "has no capture group"),
        ("reward.judge.score_regex='Score: ('", "is not a regular expression"),
        ("reward.judge.max_tokens=0", "max_tokens (0)"),
    ],
)
def test_bad_judge_config_says_what_why_and_how(override: str, message: str) -> None:
    with pytest.raises(ValidationError, match=None) as err:
        load_config("configs/ci_tiny.yaml", [override])
    assert message in str(err.value)


def test_preflight_rejects_a_judge_that_is_not_a_causal_lm(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen2ForSequenceClassification"]}')
    cfg = load_config("configs/ci_tiny.yaml", ["reward.judge.enable=true", f"reward.judge.model_path={tmp_path}"])
    with pytest.raises(ValueError, match="reward.judge.model_path"):
        preflight(cfg)


def test_iteration_metrics_of_model_rewards_by_hand() -> None:
    scored = pd.DataFrame(
        {
            "score": [1.0, 0.0, 0.0, 1.0],
            "rm_score": [None, None, None, None],  # no reward model: no rm metrics
            "judge_score": [1.0, 0.0, np.nan, 0.5],
            "judge_error": [None, None, "no match", None],
        }
    )
    m = model_reward_metrics(scored)
    # judge over the 3 read verdicts: mean (1 + 0 + 0.5) / 3 = 0.5, max 1, min 0; 1 of 4 unparsed
    assert m == {
        "reward/judge_score/mean": 0.5,
        "reward/judge_score/max": 1.0,
        "reward/judge_score/min": 0.0,
        "reward/judge_unparsed_frac": 0.25,
        "reward/rule_score/mean": 0.5,
    }
    assert model_reward_metrics(scored.drop(columns=["judge_score", "judge_error"])) == {}
