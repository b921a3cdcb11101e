"""DAPO dynamic sampling (algorithm.filter_groups): keep only groups whose rollouts do not all share one
reward, generating further rounds of prompts until train_batch_size groups are kept.

- the prompt_batches partition holds every candidate round of the iteration (stages.prompt_batches);
- the rollout stage generates round after round (`generate_until_full`) and stops as soon as enough
  groups pass the filter; the rollouts / scored_rollouts tables keep all generated rounds;
- the advantage stage keeps the first train_batch_size passing groups (`select_training_groups`, in
  round, then group order).

Yu et al. 2025, https://arxiv.org/abs/2503.14476 (section 3.2); verl's filter_groups names.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
import torch

from configs.schema import FilterGroupsConfig
from stages.algos.dapo import filter_groups_by_variance


def filter_metric(scored: pd.DataFrame, metric: str, correct_score: float) -> np.ndarray:
    """Per-rollout values the group filter compares: acc (score >= correct_score), score, or seq_reward."""
    if metric == "acc":
        return (scored["score"].to_numpy(dtype=np.float64) >= correct_score).astype(np.float64)
    if metric == "score":
        return scored["score"].to_numpy(dtype=np.float64)
    if metric == "seq_reward":
        return scored["reward"].to_numpy(dtype=np.float64)
    raise ValueError(f"Unknown algorithm.filter_groups.metric '{metric}'. Valid: ['acc', 'score', 'seq_reward']")


def kept_group_ids(scored: pd.DataFrame, metric: str, correct_score: float) -> list[int]:
    """Group ids whose rollouts do not all share one metric value, or that hold one rollout (verl's DAPO
    filter keeps those: std > 0 or a single member), in order of first rollout_id."""
    keep = filter_groups_by_variance(
        torch.tensor(filter_metric(scored, metric, correct_score)),
        torch.tensor(scored["group_id"].to_numpy(dtype=np.int64)),
        keep_singletons=True,
    )
    ordered = scored.assign(_keep=keep.numpy()).sort_values("rollout_id")
    return list(dict.fromkeys(ordered.loc[ordered["_keep"], "group_id"].tolist()))


def generate_until_full(
    batch: pd.DataFrame,
    generate: Callable[[pd.DataFrame, int, int], list],
    score: Callable[[list], pd.DataFrame],
    *,
    metric: str,
    correct_score: float,
    need_groups: int,
) -> list[list]:
    """Generate round after round of `batch` (a prompt_batches partition with gen_round) until `need_groups`
    groups pass the filter; returns each generated round's pass (all are kept: gen_round, unique rollout_id).

    generate(prompts of one round, round, its first rollout_id) -> the pass's results (ShardResults: `rows` each);
    score(a pass's results) -> its rows with `group_id`, `rollout_id`, `score` and `reward` (used only to decide
    whether to stop)."""
    passes, kept, offset = [], 0, 0
    rounds = sorted(int(r) for r in batch["gen_round"].unique())
    for r in rounds:
        results = generate(batch[batch["gen_round"] == r].reset_index(drop=True), r, offset)
        offset += sum(res.rows for res in results)
        passes.append(results)
        kept += len(kept_group_ids(score(results), metric, correct_score))
        if kept >= need_groups:
            return passes
    raise ValueError(
        f"dynamic sampling kept {kept} groups after {len(rounds)} generation rounds, fewer than "
        f"data.train_batch_size ({need_groups}), because the other groups' rollouts all got the same "
        f"'{metric}'; raise algorithm.filter_groups.max_num_gen_batches (0 = until the prompts run out) or "
        "data.gen_batch_size, or pick an easier/harder dataset (verl: 'Generated too many')."
    )


def select_training_groups(
    scored: pd.DataFrame, filter_cfg: FilterGroupsConfig, *, need_groups: int, correct_score: float
) -> pd.DataFrame:
    """The rows of the first `need_groups` groups that pass the filter (all rows when it is off)."""
    if not filter_cfg.enable:
        return scored
    groups = kept_group_ids(
        split_baseline_rows(scored)[0], filter_cfg.metric, correct_score
    )  # ReMax baselines: no vote
    if len(groups) < need_groups:
        raise ValueError(
            f"only {len(groups)} groups of the scored rollouts pass the filter_groups '{filter_cfg.metric}' filter, "
            f"fewer than data.train_batch_size ({need_groups}); this happens when rollouts were re-scored with "
            "another reward after generation stopped: re-materialize rollouts too, or disable filter_groups."
        )
    chosen = set(groups[:need_groups])
    return scored[scored["group_id"].isin(chosen)].sort_values("rollout_id").reset_index(drop=True)  # + baselines


def split_baseline_rows(scored: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(training samples, ReMax greedy baseline rows) of scored rollouts; no is_baseline column = no baselines."""
    base = scored["is_baseline"].astype(bool).to_numpy() if "is_baseline" in scored else np.zeros(len(scored), bool)
    return scored[~base].reset_index(drop=True), scored[base].reset_index(drop=True)
