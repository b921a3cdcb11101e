"""Advantage stage: group statistics in one pass over the iteration's batch (no shuffle)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from stages.algos.advantages import compute_grpo_advantages


def compute_advantage_table(scored: pd.DataFrame, algorithm_cfg) -> pd.DataFrame:
    """Rows of the advantages table for one iteration's scored rollouts."""
    rewards = scored["reward"].to_numpy(dtype=np.float64)
    if not np.isfinite(rewards).all():
        bad = scored.loc[~np.isfinite(rewards), "rollout_id"].tolist()[:10]
        raise ValueError(f"non-finite rewards for rollouts {bad} (see reward_error in scored_rollouts); "
                         "fix the reward function or re-score before computing advantages")
    r = torch.tensor(rewards, dtype=torch.float32)
    g = torch.tensor(scored["group_id"].to_numpy(dtype=np.int64))
    if algorithm_cfg.adv_estimator != "grpo":
        raise ValueError(f"Unknown adv_estimator '{algorithm_cfg.adv_estimator}'. Valid: ['grpo']")
    adv = compute_grpo_advantages(r, g, scale_by_std=algorithm_cfg.norm_adv_by_std_in_grpo)
    return pd.DataFrame({
        "rollout_id": scored["rollout_id"].to_numpy(), "group_id": scored["group_id"].to_numpy(),
        "policy_version": scored["policy_version"].to_numpy(),
        "prompt_token_ids": scored["prompt_token_ids"].to_numpy(),
        "response_token_ids": scored["response_token_ids"].to_numpy(),
        "reward": rewards, "advantage": adv.numpy(), "adv_estimator": algorithm_cfg.adv_estimator,
    })
