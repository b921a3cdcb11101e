"""Deterministic rollout rows for trainer tests (imported by test modules)."""

from __future__ import annotations

import pandas as pd
import torch


def scored_rows(rewards: list[float], lengths: list[int], masks: list | None = None) -> pd.DataFrame:
    """Scored rollouts for the advantage stage: groups of 4, 2-token prompts, responses of `lengths` tokens,
    `rewards`; with masks (one 0/1 list or None per row) a multi-turn `response_mask` column."""
    n = len(rewards)
    out = pd.DataFrame(
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
    if masks is not None:
        out["response_mask"] = pd.Series(masks, dtype=object)
    return out


def make_rows(n: int, seed: int = 0, vocab: int = 80) -> pd.DataFrame:
    """n rollouts in groups of 4 with varied prompt/response lengths and +-1 advantages."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        p_len = 4 + int(torch.randint(0, 4, (1,), generator=g))
        r_len = 2 + int(torch.randint(0, 5, (1,), generator=g))
        rows.append(
            {
                "rollout_id": i,
                "group_id": i // 4,
                "policy_version": 0,
                "prompt_token_ids": torch.randint(5, vocab, (p_len,), generator=g).tolist(),
                "response_token_ids": torch.randint(5, vocab, (r_len,), generator=g).tolist(),
                "reward": float(i % 2),
                "advantage": 1.0 if i % 2 else -1.0,
                "adv_estimator": "grpo",
                "token_advantages": [1.0 if i % 2 else -1.0] * r_len,
            }
        )
    return pd.DataFrame(rows)


def as_trainer_rows(df: pd.DataFrame) -> dict:
    return {
        "prompt_token_ids": list(df["prompt_token_ids"]),
        "response_token_ids": list(df["response_token_ids"]),
        "advantages": torch.tensor(df["advantage"].to_numpy(), dtype=torch.float32),
    }
