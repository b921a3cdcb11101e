"""The advantage stage for every wired estimator on a 2-group batch, against hand-derived values."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from configs.schema import AlgorithmConfig
from stages.advantage import compute_advantage_table


def _scored(rewards: list[float], lengths: list[int]) -> pd.DataFrame:
    n = len(rewards)
    return pd.DataFrame(
        {
            "rollout_id": range(n),
            "group_id": [i // 4 for i in range(n)],
            "policy_version": 0,
            "prompt_token_ids": [[5, 6]] * n,
            "response_token_ids": [[7] * k for k in lengths],
            "response_length": lengths,
            "reward": rewards,
        }
    )


def test_grpo_rows_hand_derived() -> None:
    # group 0 rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.866025
    # group 1 rewards [1, 1, 1, 1]: all equal -> 0
    out = compute_advantage_table(_scored([1, 0, 0, 1, 1, 1, 1, 1], [3, 2, 4, 1, 2, 2, 2, 2]), AlgorithmConfig())
    assert out["advantage"].tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0], abs=1e-5)
    assert [len(t) for t in out["token_advantages"]] == [3, 2, 4, 1, 2, 2, 2, 2]
    assert out["token_advantages"].iloc[2] == pytest.approx([-0.866025] * 4, abs=1e-5)  # outcome: same on every token


def test_dr_grpo_and_rloo_hand_derived() -> None:
    scored = _scored([1, 0, 0, 1], [2, 2, 2, 2])
    dr = compute_advantage_table(scored, AlgorithmConfig(norm_adv_by_std_in_grpo=False))
    assert dr["advantage"].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])  # r - mean, no std
    rloo = compute_advantage_table(scored, AlgorithmConfig(adv_estimator="rloo"))
    # leave-one-out: 1 - (0+0+1)/3 = 2/3 ; 0 - (1+0+1)/3 = -2/3
    assert rloo["advantage"].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_every_wired_estimator_gives_finite_token_advantages(name: str) -> None:
    out = compute_advantage_table(
        _scored([1, 0, 0, 1, 0, 1, 0, 0], [3, 2, 4, 1, 5, 2, 3, 2]), AlgorithmConfig(adv_estimator=name)
    )
    assert all(np.isfinite(t).all() for t in out["token_advantages"])
    assert out["adv_estimator"].unique().tolist() == [name]


def test_non_finite_reward_is_refused_with_rollout_ids() -> None:
    with pytest.raises(ValueError, match=r"non-finite rewards for rollouts \[1\]"):
        compute_advantage_table(_scored([1, float("nan"), 0, 1], [2, 2, 2, 2]), AlgorithmConfig())
