"""The advantage stage for every wired estimator on a 2-group batch, against hand-derived values."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from configs.schema import AlgorithmConfig
from stages.advantage_table import compute_advantage_table

sys.path.insert(0, str(Path(__file__).parent))
from helpers_rollouts import scored_rows


def test_grpo_rows_hand_derived() -> None:
    # group 0 rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.866025
    # group 1 rewards [1, 1, 1, 1]: all equal -> 0
    out = compute_advantage_table(scored_rows([1, 0, 0, 1, 1, 1, 1, 1], [3, 2, 4, 1, 2, 2, 2, 2]), AlgorithmConfig())
    assert out["advantage"].tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0], abs=1e-5)
    assert [len(t) for t in out["token_advantages"]] == [3, 2, 4, 1, 2, 2, 2, 2]
    assert out["token_advantages"].iloc[2] == pytest.approx([-0.866025] * 4, abs=1e-5)  # outcome: same on every token


def test_dr_grpo_and_rloo_hand_derived() -> None:
    scored = scored_rows([1, 0, 0, 1], [2, 2, 2, 2])
    dr = compute_advantage_table(scored, AlgorithmConfig(norm_adv_by_std_in_grpo=False))
    assert dr["advantage"].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])  # r - mean, no std
    rloo = compute_advantage_table(scored, AlgorithmConfig(adv_estimator="rloo"))
    # leave-one-out: 1 - (0+0+1)/3 = 2/3 ; 0 - (1+0+1)/3 = -2/3
    assert rloo["advantage"].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_every_wired_estimator_gives_finite_token_advantages(name: str) -> None:
    out = compute_advantage_table(
        scored_rows([1, 0, 0, 1, 0, 1, 0, 0], [3, 2, 4, 1, 5, 2, 3, 2]), AlgorithmConfig(adv_estimator=name)
    )
    assert all(np.isfinite(t).all() for t in out["token_advantages"])
    assert out["adv_estimator"].unique().tolist() == [name]


def test_non_finite_reward_is_refused_with_rollout_ids() -> None:
    with pytest.raises(ValueError, match=r"non-finite rewards for rollouts \[1\]"):
        compute_advantage_table(scored_rows([1, float("nan"), 0, 1], [2, 2, 2, 2]), AlgorithmConfig())


def test_kl_in_reward_uses_the_actors_old_logprobs() -> None:
    """verl's apply_kl_penalty takes the actor's recomputed old_log_prob, not the engine's sampling log-probs:
    with an old_logprobs table that differs from rollout_logprobs, the KL and the rewards follow the table."""
    from configs.schema import KLControlConfig
    from stages.old_logprobs import probs_gap

    scored = pd.DataFrame(
        {
            "rollout_id": [0, 1],
            "group_id": [0, 0],
            "policy_version": 0,
            "prompt_token_ids": [[5, 6], [5, 6]],
            "response_token_ids": [[7, 8], [9, 10]],
            "response_length": [2, 2],
            "reward": [1.0, 0.0],
            "rollout_logprobs": [[-1.0, -1.0], [-2.0, -2.0]],  # the engine's: not used by the KL any more
        }
    )
    ref = pd.DataFrame({"rollout_id": [0, 1], "ref_logprobs": [[-1.5, -1.0], [-2.0, -3.0]]})
    old_lists = {1: [-2.0, -1.0], 0: [-0.5, -1.0]}  # the actor's, in another row order than scored
    # |exp(old) - exp(engine)|: row 0 [e^-0.5 - e^-1, 0] = [0.238651, 0] -> max 0.238651, mean 0.119326
    #                           row 1 [0, e^-1 - e^-2] = [0, 0.232544]    -> max 0.232544, mean 0.116272
    old = pd.DataFrame(
        {
            "rollout_id": [1, 0],
            "old_logprobs": [old_lists[1], old_lists[0]],
            "rollout_probs_diff_max": [0.232544, 0.238651],
            "rollout_probs_diff_mean": [0.116272, 0.119326],
        }
    )
    cfg = AlgorithmConfig(
        norm_adv_by_std_in_grpo=False, use_kl_in_reward=True, kl_penalty="kl", kl_ctrl=KLControlConfig(kl_coef=0.1)
    )
    out = compute_advantage_table(scored, cfg, ref=ref, kl_coef=0.1, old=old)
    # k1 = old - ref: row 0 [-0.5 + 1.5, -1 + 1] = [1, 0], row 1 [-2 + 2, -1 + 3] = [0, 2]; beta 0.1
    # token rewards: row 0 [-0.1, 1 - 0] (sum 0.9), row 1 [0, 0 - 0.2] (sum -0.2)
    # Dr.GRPO on the sums: mean 0.35 -> advantages +0.55, -0.55 (the engine's log-probs would give +-0.525)
    assert out["advantage"].tolist() == pytest.approx([0.55, -0.55], abs=1e-6)
    assert out["reward_kl"].tolist() == pytest.approx([0.5, 1.0])  # token-mean KL per rollout
    # the rows carry the table's old log-probs and per-rollout gap, aligned by rollout_id
    assert out["old_logprobs"].tolist() == [old_lists[0], old_lists[1]]
    assert out["rollout_probs_diff_max"].tolist() == pytest.approx([0.238651, 0.232544], abs=1e-6)
    assert out["rollout_probs_diff_mean"].tolist() == pytest.approx([0.119326, 0.116272], abs=1e-6)
    _, row_max, row_mean = probs_gap([old_lists[0], old_lists[1]], scored["rollout_logprobs"].tolist())
    assert row_max.tolist() == pytest.approx([0.238651, 0.232544], abs=1e-6)  # what the old_logprobs stage stores
    assert row_mean.tolist() == pytest.approx([0.119326, 0.116272], abs=1e-6)
    # the iteration's verl metrics over the 4 tokens: max 0.238651, mean (0.238651 + 0.232544) / 4 = 0.117799
    from stages.iteration_metrics import algorithm_metrics

    m = algorithm_metrics(scored, out)
    assert m["training/rollout_probs_diff_valid"] == 1
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.238651, abs=1e-6)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.117799, abs=1e-6)
    assert "training/rollout_probs_diff_max" not in algorithm_metrics(
        scored, compute_advantage_table(scored, cfg, ref=ref)
    )
    with pytest.raises(ValueError, match=r"rollouts \[0\] have no old log-probs"):
        compute_advantage_table(scored, cfg, ref=ref, kl_coef=0.1, old=old.iloc[:1])


def test_rows_without_old_logprobs_table_have_empty_lists_and_nan_gap() -> None:
    out = compute_advantage_table(scored_rows([1, 0, 0, 1], [2, 2, 2, 2]), AlgorithmConfig())
    assert out["old_logprobs"].tolist() == [[]] * 4
    assert np.isnan(out["rollout_probs_diff_max"]).all() and np.isnan(out["rollout_probs_diff_mean"]).all()
