"""ReMax in the pipeline: greedy baseline rows (is_baseline) next to the samples, their reward as each
group's baseline in the advantage stage, and kept out of training, filters and metrics."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from configs.schema import (
    AlgorithmConfig,
    FilterGroupsConfig,
    RolloutConfig,
    load_config,
)
from stages.advantage_table import compute_advantage_table, drop_flagged_rollouts
from stages.filter_groups import select_training_groups
from stages.iteration_metrics import rollout_metrics

REMAX = AlgorithmConfig(adv_estimator="remax")


def _scored() -> pd.DataFrame:
    """2 groups x (2 samples + 1 greedy baseline); the baseline rows sit between the samples on purpose."""
    rows = [  # rollout_id, group_id, is_baseline, reward, response_length
        (0, 0, False, 1.0, 3),
        (1, 0, False, 0.0, 2),
        (4, 0, True, 0.1, 2),
        (5, 1, True, 1.0, 1),
        (2, 1, False, 0.1, 2),
        (3, 1, False, 1.0, 4),
    ]
    return pd.DataFrame(
        {
            "rollout_id": [r[0] for r in rows],
            "group_id": [r[1] for r in rows],
            "is_baseline": [r[2] for r in rows],
            "sample_index": [-1 if r[2] else 0 for r in rows],
            "reward": [r[3] for r in rows],
            "response_length": [r[4] for r in rows],
            "policy_version": 0,
            "prompt_token_ids": [[5, 6]] * len(rows),
            "response_token_ids": [[7] * r[4] for r in rows],
            "finish_reason": "stop",
            "score": [r[3] for r in rows],
        }
    )


def test_remax_advantages_hand_derived_without_baseline_rows() -> None:
    # outcome reward on the last token, return-to-go = reverse cumsum = the reward on every token;
    # advantage = return - b(group): group 0 b = 0.1 (its greedy row): 1.0 - 0.1 = 0.9, 0.0 - 0.1 = -0.1;
    # group 1 b = 1.0: 0.1 - 1.0 = -0.9, 1.0 - 1.0 = 0 (the greedy answer was already right: no signal)
    out = compute_advantage_table(_scored(), REMAX)
    assert out["rollout_id"].tolist() == [0, 1, 2, 3]  # baseline rows 4, 5 are not training samples
    assert out["advantage"].tolist() == pytest.approx([0.9, -0.1, -0.9, 0.0], abs=1e-6)
    assert out["reward"].tolist() == [1.0, 0.0, 0.1, 1.0]
    assert out["token_advantages"].iloc[0] == pytest.approx([0.9] * 3, abs=1e-6)  # same on every token, no whitening
    assert out["token_advantages"].iloc[3] == pytest.approx([0.0] * 4, abs=1e-6)
    assert out["returns"].iloc[2] == pytest.approx([0.1, 0.1], abs=1e-6)
    assert set(out["adv_estimator"]) == {"remax"}


def test_remax_group_without_or_with_two_baselines_is_a_clear_error() -> None:
    scored = _scored()
    with pytest.raises(ValueError, match=r"groups \[1\] have none. Re-materialize rollouts"):
        compute_advantage_table(scored[scored["rollout_id"] != 5], REMAX)
    with pytest.raises(ValueError, match=r"groups \[0\] have several"):
        compute_advantage_table(pd.concat([scored, scored[scored["rollout_id"] == 4].assign(rollout_id=6)]), REMAX)
    with pytest.raises(ValueError, match=r"groups \[0, 1\] have none"):  # rollouts of a non-remax run
        compute_advantage_table(scored[~scored["is_baseline"]].drop(columns=["is_baseline"]), REMAX)


def test_other_estimators_never_see_baseline_rows() -> None:
    scored = _scored()
    with_baselines = compute_advantage_table(scored, AlgorithmConfig(adv_estimator="rloo"))
    without = compute_advantage_table(
        scored[~scored["is_baseline"]].reset_index(drop=True), AlgorithmConfig(adv_estimator="rloo")
    )
    assert with_baselines["rollout_id"].tolist() == [0, 1, 2, 3]
    # leave-one-out within the 2 samples only: 1.0 - 0.0 = 1, 0.0 - 1.0 = -1; 0.1 - 1.0 = -0.9, 1.0 - 0.1 = 0.9
    assert with_baselines["advantage"].tolist() == pytest.approx([1.0, -1.0, -0.9, 0.9], abs=1e-6)
    pd.testing.assert_frame_equal(with_baselines, without)


def test_flagged_baseline_drops_its_whole_group() -> None:
    scored = _scored()
    scored.loc[scored["rollout_id"] == 5, "reward"] = np.nan  # group 1's greedy reward failed (reward.on_error=flag)
    kept, dropped = drop_flagged_rollouts(scored)
    assert dropped == 3 and sorted(kept["rollout_id"]) == [0, 1, 4]
    assert compute_advantage_table(kept, REMAX)["advantage"].tolist() == pytest.approx([0.9, -0.1], abs=1e-6)


def test_dapo_filter_ignores_baselines_and_keeps_them_with_their_group() -> None:
    scored = _scored().assign(score=[1.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # group 0 samples differ, group 1's agree
    kept = select_training_groups(
        scored, FilterGroupsConfig(enable=True, metric="score"), need_groups=1, correct_score=1.0
    )
    assert kept["rollout_id"].tolist() == [0, 1, 4]  # group 1 dropped although its baseline differs from its samples


def test_metrics_over_samples_and_the_baseline_mean() -> None:
    scored = _scored()
    m = rollout_metrics(scored, compute_advantage_table(scored, REMAX), max_response_length=4)
    assert m["critic/score/mean"] == pytest.approx((1.0 + 0.0 + 0.1 + 1.0) / 4)
    assert m["remax/baseline_reward/mean"] == pytest.approx((0.1 + 1.0) / 2)
    assert m["response_length/mean"] == pytest.approx((3 + 2 + 2 + 4) / 4)
    assert "remax/baseline_reward/mean" not in rollout_metrics(
        scored[~scored["is_baseline"]], compute_advantage_table(scored, REMAX), 4
    )


def test_remax_config_accepts_one_sample_per_prompt() -> None:
    cfg = load_config("configs/remax.yaml", ["rollout.n=1", "actor.ppo_micro_batch_size=4"])
    assert cfg.algorithm.adv_estimator == "remax" and cfg.rollout.n == 1
    with pytest.raises(ValueError, match="rollout.n \\(1\\) must be >= 2 for GRPO"):
        load_config("configs/remax.yaml", ["rollout.n=1", "algorithm.adv_estimator=grpo"])


def test_greedy_baselines_from_the_real_engine(tmp_path) -> None:
    """One greedy row per group from the same policy: deterministic, sample_index -1, ids after the samples."""
    from configs.schema import TinyModelConfig
    from stages.models.policy import encode_chat, save_policy
    from stages.models.tiny import build_char_tokenizer, build_tiny_model
    from stages.rollouts import generate_rollouts

    tok = build_char_tokenizer()
    model_dir = str(
        save_policy(
            build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), len(tok), seed=0),
            tok,
            tmp_path / "policy_v0",
        )
    )
    prompts = pd.DataFrame(
        [
            {
                "prompt_id": p,
                "prompt_token_ids": encode_chat(tok, [{"role": "user", "content": f"{p}+1="}])[0],
                "data_source": "rlake/arith",
                "ground_truth": str(p + 1),
                "prompt_text": f"{p}+1=",
                "group_id": 10 + p,
                "policy_version": 0,
                "gen_round": 0,
            }
            for p in range(3)
        ]
    )
    cfg = RolloutConfig(name="hf", n=2)

    def generate(batch: pd.DataFrame, **kw) -> pd.DataFrame:
        return generate_rollouts(batch, model_dir=model_dir, rollout_cfg=cfg, max_tokens=5, seed=0, use_ray=False, **kw)

    # as sample_rollouts does it: prompt 2 was not generated, so it gets no baseline
    sampled = generate(prompts.iloc[:2], stamp={"gen_round": 0, "is_baseline": False})
    baselines = {"is_baseline": True, "sample_index": -1}
    greedy = generate(prompts.iloc[:2], greedy=True, n=1, first_id=len(sampled), stamp=baselines)
    out = pd.concat([sampled, greedy], ignore_index=True)
    base = out[out["is_baseline"]]
    assert len(out) == 6 and out["rollout_id"].tolist() == list(range(6))
    assert base["group_id"].tolist() == [10, 11] and set(base["sample_index"]) == {-1}
    assert not out.loc[~out["is_baseline"], "sample_index"].lt(0).any()
    again = generate(prompts.iloc[:2], greedy=True, n=1)
    assert base["response_token_ids"].map(list).tolist() == again["response_token_ids"].map(list).tolist()  # argmax
