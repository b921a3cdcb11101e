"""Validation metrics of scored rollouts (stages.iteration_metrics.validation_metrics,
stages.evaluate.validation_summary), rollout.val_kwargs,
and a metric's name in Delta/UI vs MLflow (stages.metric_names): real scorers, no Ray."""

from __future__ import annotations

import pandas as pd
import pytest
from mlflow.utils.validation import _validate_metric_name
from pydantic import ValidationError

from configs.schema import RewardConfig, load_config
from stages.evaluate import validation_summary
from stages.iteration_metrics import validation_metrics
from stages.metric_names import metric_name_from_mlflow, mlflow_metric_name
from stages.scored_rollouts import score_rollouts


def _scored(data_source: str, responses: list[list[str]], ground_truth: str) -> pd.DataFrame:
    """Scored rollouts: prompt i has responses[i] (all with `ground_truth`)."""
    rows = [(p, r) for p, rs in enumerate(responses) for r in rs]
    df = pd.DataFrame(
        {
            "rollout_id": range(len(rows)),
            "prompt_id": [p for p, _ in rows],
            "data_source": data_source,
            "response_text": [r for _, r in rows],
            "ground_truth": ground_truth,
            "response_length": [len(r) for _, r in rows],
        }
    )
    return score_rollouts(df, RewardConfig(), use_ray=False)


def test_greedy_and_sampled_passes_with_a_pred():
    # math_dapo returns {"score": +-1, "acc", "pred"}: acc is verl's core variable and pred turns on maj@K
    greedy = _scored("math_dapo", [["Answer: 7"], ["Answer: 5"]], "7")
    sampled = _scored("math_dapo", [["Answer: 7", "Answer: 5"], ["Answer: 5", "Answer: 5"]], "7")
    m = validation_summary({"greedy": greedy, "sampled": sampled})
    # greedy: acc 1 and 0 -> mean@1 = 0.5; reward +1 and -1 -> mean 0 (aux: acc is the core variable)
    assert m["val-core/math_dapo/acc/mean@1"] == 0.5 and m["val-aux/math_dapo/reward/mean@1"] == 0.0
    # sampled: acc (1, 0) and (0, 0) -> prompt means 0.5 and 0 -> mean@2 = 0.25; std@2 = (0.5 + 0) / 2
    assert m["val-core/math_dapo/acc/mean@2"] == 0.25 and m["val-aux/math_dapo/acc/std@2"] == 0.25
    assert {"val-core/math_dapo/acc/maj@2/mean", "val-core/math_dapo/acc/best@2/mean"} <= set(m)
    assert "val-aux/math_dapo/score/mean@2" in m and not any("/pred/" in k for k in m)
    assert m["val/response_length/mean@1"] == 9.0 and m["val/response_length/mean@2"] == 9.0


def test_a_float_scorer_has_reward_only_and_no_majority():
    # gsm8k returns a float: the only variable is reward, and without a pred there is no maj@K
    scored = _scored("openai/gsm8k", [["#### 7", "#### 3", "#### 7"]], "7")
    m = validation_metrics(scored)
    assert m["val-core/openai/gsm8k/reward/mean@3"] == pytest.approx(2 / 3)
    assert sorted(k for k in m if k.startswith("val-core/")) == [
        "val-core/openai/gsm8k/reward/best@3/mean",
        "val-core/openai/gsm8k/reward/best@3/std",
        "val-core/openai/gsm8k/reward/mean@3",
    ]
    assert not any("maj@" in k for k in m) and "val-aux/openai/gsm8k/reward/best@2/mean" in m


def test_val_kwargs_names_and_errors():
    cfg = load_config(None, ["actor_rollout_ref.rollout.val_kwargs.n=4", "rollout.val_kwargs.temperature=0.6"])
    assert cfg.rollout.val_kwargs.n == 4 and cfg.rollout.val_kwargs.sampled_n(cfg.rollout.n) == 4
    assert load_config(None).rollout.val_kwargs.sampled_n(8) == 8  # null: rollout.n
    assert load_config(None, ["rollout.val_kwargs.do_sample=false"]).rollout.val_kwargs.sampled_n(8) == 0
    with pytest.raises(ValidationError, match="val_kwargs.n=1 with do_sample=true"):
        load_config(None, ["rollout.val_kwargs.n=1"])
    with pytest.raises(ValidationError, match="val_kwargs.n=4 with do_sample=false"):
        load_config(None, ["rollout.val_kwargs.n=4", "rollout.val_kwargs.do_sample=false"])


def test_mlflow_names_are_valid_and_map_back():
    scored = _scored("math_dapo", [["Answer: 7", "Answer: 5", "Answer: 5", "x"]], "7")
    names = [*validation_summary({"sampled": scored}), "actor/pg_loss", "timing_s/testing"]
    for name in names:
        key = mlflow_metric_name(name)
        _validate_metric_name(key)  # MLflow's own check: raises on '@'
        assert metric_name_from_mlflow(key) == name
    assert mlflow_metric_name("val-core/rlake/arith/reward/mean@1") == "val-core/rlake/arith/reward/mean_at_1"
    assert mlflow_metric_name("val-core/d/acc/maj@4/mean") == "val-core/d/acc/maj_at_4/mean"
