"""Reward stage: score each rollout with the rule-based function of its data_source.

Runs as parallel Ray Data tasks. A reward function that raises, or returns a non-finite value,
is a clear error naming the rollout (reward.on_error='raise'), or flags the row with
reward_error and reward NaN so downstream checks can gate it (reward.on_error='flag').
"""
from __future__ import annotations

import math

import pandas as pd

from stages.rewards import reward_fn_for
from stages.ray_data import map_with_actor_pool


class RewardStage:
    """ds.map_batches(RewardStage, fn_constructor_kwargs={"cfg": reward_cfg}) or called directly."""

    def __init__(self, format_score: float = 0.0, score: float = 1.0, on_error: str = "raise") -> None:
        self.kw = {"format_score": format_score, "score": score}
        self.on_error = on_error

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        rewards, names, errors = [], [], []
        for rid, ds, text, gt in zip(batch["rollout_id"], batch["data_source"], batch["response_text"],
                                     batch["ground_truth"]):
            fn = reward_fn_for(ds)
            try:
                value = float(fn(text, gt, **self.kw))
                if not math.isfinite(value):
                    raise ValueError(f"returned non-finite {value}")
                err = None
            except Exception as exc:  # noqa: BLE001 - user reward code; reported with the row
                if self.on_error == "raise":
                    raise ValueError(f"reward function {fn.__name__} for data_source '{ds}' failed on rollout "
                                     f"{rid}: {exc}. Fix the function or set reward.on_error='flag'.") from exc
                value, err = float("nan"), f"{type(exc).__name__}: {exc}"
            rewards.append(value)
            names.append(f"{fn.__module__}.{fn.__name__}")
            errors.append(err)
        return batch.assign(reward=rewards, reward_fn=names, reward_error=errors)


def score_rollouts(rollouts: pd.DataFrame, reward_cfg, *, use_ray: bool = True) -> pd.DataFrame:
    """Score all rollouts; the output keeps every input column plus reward, reward_fn, reward_error."""
    for ds in rollouts["data_source"].unique():  # unknown data_source: fail before any work
        reward_fn_for(ds)
    kwargs = {"format_score": reward_cfg.format_score, "score": reward_cfg.score, "on_error": reward_cfg.on_error}
    if not use_ray:
        return RewardStage(**kwargs)(rollouts)
    parts = max(1, min(reward_cfg.num_workers, len(rollouts)))
    out = map_with_actor_pool(rollouts, RewardStage, kwargs, workers=parts, cpus_per_actor=0.5)
    return out.sort_values("rollout_id").reset_index(drop=True)
