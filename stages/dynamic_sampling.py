"""DAPO dynamic sampling in the pipeline (algorithm.filter_groups): generate rounds of prompts until
train_batch_size groups with reward spread are kept, persisting every generated rollout.

- prompt_batches holds every candidate round of an iteration (`gen_round`): round 0 is the epoch
  cursor's gen_batch_size prompts; rounds 1.. come from a stream seeded by (seed, iteration) over the
  other training prompts (negative `position`: not from the cursor), so re-runs draw the same prompts.
- the rollout stage generates round after round and stops as soon as enough groups pass the filter;
  the rollouts / scored_rollouts tables keep all generated rounds.
- the advantage stage keeps the first train_batch_size passing groups (in round, then group order).

ReMax (algorithm.adv_estimator='remax', Li et al. 2023, https://arxiv.org/abs/2310.10505) also lives
here: after sampling, one greedy response per generated prompt with the same policy, stored in the
rollouts table as `is_baseline` rows (sample_index -1); the filter and the advantage stage leave them out
of the training set and use their reward as the group's baseline.

Yu et al. 2025, https://arxiv.org/abs/2503.14476 (section 3.2); verl's filter_groups names.
"""
from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pandas as pd
import torch

from stages.advantage import split_baseline_rows
from stages.algos.dapo import filter_groups_by_variance


def prompt_rounds(train_ids: list[int], first: list[tuple[int, int, int]], iteration: int, *, gen_batch_size: int,
                  max_rounds: int, seed: int) -> list[tuple[int, int, int, int]]:
    """(prompt_id, epoch, position, gen_round) of every candidate prompt of the iteration.

    Args:
        first: round 0, the epoch cursor's (prompt_id, epoch, position) triples.
        max_rounds: cap on rounds (algorithm.filter_groups.max_num_gen_batches); 0 = as many full rounds
            as the other training prompts fill.
    """
    out = [(p, e, pos, 0) for p, e, pos in first]
    taken = {p for p, _, _ in first}
    rest = [p for p in train_ids if p not in taken]
    random.Random(seed * 1_000_003 + iteration).shuffle(rest)
    extra = len(rest) // gen_batch_size
    if max_rounds > 0:
        extra = min(extra, max_rounds - 1)
    epoch = first[0][1] if first else 0
    for k, p in enumerate(rest[:extra * gen_batch_size]):
        out.append((p, epoch, -1 - k, 1 + k // gen_batch_size))
    return out


def add_greedy_baselines(sampled: pd.DataFrame, prompts: pd.DataFrame,
                         generate_greedy: Callable[[pd.DataFrame], pd.DataFrame]) -> pd.DataFrame:
    """`sampled` plus one greedy response per group it holds (ReMax), marked is_baseline with sample_index -1
    and rollout_ids after the sampled ones (unique in the iteration); sampled rows get is_baseline False.

    prompts: the prompt rows (one per group_id, as in the prompt batch); generate_greedy(prompts) -> one
    rollout per prompt row, carrying its group_id."""
    groups = prompts[prompts["group_id"].isin(set(sampled["group_id"]))].reset_index(drop=True)
    greedy = generate_greedy(groups)
    if len(greedy) != len(groups) or set(greedy["group_id"]) != set(groups["group_id"]):
        raise ValueError(f"the greedy baseline pass returned {len(greedy)} rollouts for {len(groups)} prompts; "
                         "ReMax needs exactly one per prompt (generate with n=1)")
    start = int(sampled["rollout_id"].max()) + 1
    greedy = greedy.assign(sample_index=-1, is_baseline=True, rollout_id=np.arange(start, start + len(greedy)))
    return pd.concat([sampled.assign(is_baseline=False), greedy], ignore_index=True)


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
    """Group ids whose rollouts do not all share one metric value, in order of first rollout_id."""
    keep = filter_groups_by_variance(torch.tensor(filter_metric(scored, metric, correct_score)),
                                     torch.tensor(scored["group_id"].to_numpy(dtype=np.int64)))
    ordered = scored.assign(_keep=keep.numpy()).sort_values("rollout_id")
    return list(dict.fromkeys(ordered.loc[ordered["_keep"], "group_id"].tolist()))


def generate_until_full(batch: pd.DataFrame, generate: Callable[[pd.DataFrame, int], pd.DataFrame],
                        score: Callable[[pd.DataFrame], pd.DataFrame], *, metric: str, correct_score: float,
                        need_groups: int) -> pd.DataFrame:
    """Generate round after round of `batch` (a prompt_batches partition with gen_round) until
    `need_groups` groups pass the filter; returns all generated rollouts (gen_round, unique rollout_id).

    generate(prompts of one round, round) -> rollouts with rollout_id 0..; score(rollouts) -> the same
    rows with a `score` and `reward` column (used only to decide whether to stop)."""
    parts, kept, offset = [], 0, 0
    rounds = sorted(int(r) for r in batch["gen_round"].unique())
    for r in rounds:
        out = generate(batch[batch["gen_round"] == r].reset_index(drop=True), r)
        out = out.assign(gen_round=r, rollout_id=out["rollout_id"].to_numpy() + offset)
        offset += len(out)
        parts.append(out)
        kept += len(kept_group_ids(score(out), metric, correct_score))
        if kept >= need_groups:
            return pd.concat(parts, ignore_index=True)
    raise ValueError(
        f"dynamic sampling kept {kept} groups after {len(rounds)} generation rounds, fewer than "
        f"data.train_batch_size ({need_groups}), because the other groups' rollouts all got the same "
        f"'{metric}'; raise algorithm.filter_groups.max_num_gen_batches (0 = until the prompts run out) or "
        "data.gen_batch_size, or pick an easier/harder dataset (verl: 'Generated too many').")


def select_training_groups(scored: pd.DataFrame, filter_cfg, *, need_groups: int, correct_score: float) -> pd.DataFrame:
    """The rows of the first `need_groups` groups that pass the filter (all rows when it is off)."""
    if not filter_cfg.enable:
        return scored
    groups = kept_group_ids(split_baseline_rows(scored)[0], filter_cfg.metric, correct_score)  # ReMax baselines: no vote
    if len(groups) < need_groups:
        raise ValueError(
            f"only {len(groups)} groups of the scored rollouts pass the filter_groups '{filter_cfg.metric}' filter, "
            f"fewer than data.train_batch_size ({need_groups}); this happens when rollouts were re-scored with "
            "another reward after generation stopped: re-materialize rollouts too, or disable filter_groups.")
    chosen = set(groups[:need_groups])
    return scored[scored["group_id"].isin(chosen)].sort_values("rollout_id").reset_index(drop=True)  # + baselines


def iteration_prompts(train_ids: list[int], iteration: int, cfg) -> list[tuple[int, int, int, int]]:
    """(prompt_id, epoch, position, gen_round) of the iteration's prompt batch: train_batch_size prompts
    of the epoch cursor, or, with filter_groups, every candidate round of gen_batch_size prompts."""
    from stages.data import sample_prompt_batch

    fg = cfg.algorithm.filter_groups
    size = (cfg.data.gen_batch_size or cfg.data.train_batch_size) if fg.enable else cfg.data.train_batch_size
    first = sample_prompt_batch(train_ids, iteration, size, seed=cfg.seed, shuffle=cfg.data.shuffle)
    if not fg.enable:
        return [(p, e, pos, 0) for p, e, pos in first]
    return prompt_rounds(train_ids, first, iteration, gen_batch_size=size, max_rounds=fg.max_num_gen_batches,
                         seed=cfg.seed)


def sample_rollouts(batch: pd.DataFrame, *, model_dir: str, cfg, iteration: int) -> pd.DataFrame:
    """The iteration's rollouts: one generation of the batch, or DAPO rounds until the batch is full; with
    adv_estimator='remax' plus one greedy baseline row per generated prompt (add_greedy_baselines).
    batch: a prompt_batches partition with group_id and policy_version set."""
    from stages.reward import score_rollouts
    from stages.rollout import generate_rollouts

    def generate(prompts: pd.DataFrame, r: int) -> pd.DataFrame:
        return generate_rollouts(prompts, model_dir=model_dir, rollout_cfg=cfg.rollout,
                                 max_tokens=cfg.data.max_response_length, seed=cfg.rollout.seed + iteration + 100_003 * r)

    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        out = generate(batch, 0).assign(gen_round=0)
    else:
        out = generate_until_full(
            batch, generate, lambda out: score_rollouts(out, cfg.reward, use_ray=False,
                                                        max_response_length=cfg.data.max_response_length),
            metric=fg.metric, correct_score=cfg.reward.score, need_groups=cfg.data.train_batch_size)
    if cfg.algorithm.adv_estimator != "remax":
        return out
    return add_greedy_baselines(out, batch, lambda prompts: generate_rollouts(
        prompts, model_dir=model_dir, rollout_cfg=cfg.rollout, max_tokens=cfg.data.max_response_length,
        seed=cfg.rollout.seed + iteration, greedy=True, n=1))
