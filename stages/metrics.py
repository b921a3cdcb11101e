"""Iteration metrics with verl's names (critic/score/mean, response_length/mean, ...)."""
from __future__ import annotations

import numpy as np
import pandas as pd


def _stats(prefix: str, values: np.ndarray) -> dict[str, float]:
    values = np.asarray(values, dtype=np.float64)
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def rollout_metrics(scored: pd.DataFrame, advantages: pd.DataFrame, max_response_length: int) -> dict[str, float]:
    lengths = scored["response_length"].to_numpy()
    m = {**_stats("critic/score", scored["reward"]), **_stats("critic/rewards", scored["reward"]),
         **_stats("critic/advantages", advantages["advantage"]), **_stats("response_length", lengths),
         **_stats("prompt_length", scored["prompt_token_ids"].map(len))}
    m["response_length/clip_ratio"] = float((scored["finish_reason"] == "length").mean())
    groups = scored.groupby("group_id")["reward"]
    m["critic/score/group_all_equal_frac"] = float((groups.nunique() == 1).mean())
    return m


def validation_metrics(scored: pd.DataFrame, tag: str) -> dict[str, float]:
    """verl-style val metrics per data_source: val-core/<ds>/reward/<tag>."""
    out = {}
    for ds, part in scored.groupby("data_source"):
        out[f"val-core/{ds}/reward/{tag}"] = float(part["reward"].mean())
    return out
