"""Advantage stage: group statistics in one pass over the iteration's batch (no shuffle).

The outcome reward sits on each response's last token; `algorithm.adv_estimator` turns it into
token-level advantages (stages.algos.advantages.compute_advantages). The table keeps the
per-token values and, in `advantage`, the first token's (the per-rollout scalar for outcome
estimators such as GRPO and RLOO).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from stages.algos.advantages import compute_advantages, outcome_to_token_rewards


def compute_advantage_table(scored: pd.DataFrame, algorithm_cfg) -> pd.DataFrame:
    """Rows of the advantages table for one iteration's scored rollouts."""
    rewards = scored["reward"].to_numpy(dtype=np.float64)
    if not np.isfinite(rewards).all():
        bad = scored.loc[~np.isfinite(rewards), "rollout_id"].tolist()[:10]
        raise ValueError(f"non-finite rewards for rollouts {bad} (see reward_error in scored_rollouts); "
                         "fix the reward function or re-score before computing advantages")
    lengths = torch.tensor(scored["response_length"].to_numpy(dtype=np.int64))
    width = max(1, int(lengths.max()))
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()  # (N, L)
    token_rewards = outcome_to_token_rewards(torch.tensor(rewards, dtype=torch.float32), mask)  # (N, L)
    adv, _ = compute_advantages(algorithm_cfg.adv_estimator, token_level_rewards=token_rewards, response_mask=mask,
                                group_ids=torch.tensor(scored["group_id"].to_numpy(dtype=np.int64)),
                                gamma=algorithm_cfg.gamma, norm_adv_by_std_in_grpo=algorithm_cfg.norm_adv_by_std_in_grpo)
    token_adv = [adv[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
    return pd.DataFrame({
        "rollout_id": scored["rollout_id"].to_numpy(), "group_id": scored["group_id"].to_numpy(),
        "policy_version": scored["policy_version"].to_numpy(),
        "prompt_token_ids": scored["prompt_token_ids"].to_numpy(),
        "response_token_ids": scored["response_token_ids"].to_numpy(),
        "reward": rewards, "advantage": adv[:, 0].numpy(), "token_advantages": token_adv,
        "adv_estimator": algorithm_cfg.adv_estimator,
    })
