"""The old_logprobs stage: per-token log-probs of every rollout's response under the policy that sampled it
(policy version == iteration), recomputed by the trainer before the advantages (verl's `compute_log_prob`,
whose output is `old_log_prob`).

Flow: assets/old_logprobs.py `old_logprobs` -> `policy_old_logprobs(cfg, rollouts, policy_dir, sink)` ->
`old_logprob_shards`, which gives each rank of the run's "actor" worker group (the update's own group,
stages.policy_checkpoint.actor_workers: no extra processes) a contiguous slice of the rollouts partition at its recorded
version; the rank reads it, calls `ActorWorker.compute_log_prob` (stages/workers/actor_worker.py), computes its
rows' gap to the engine (`finish_old_logprobs`) and writes its rows as one Parquet file; the asset commits the
files once (stages/workers/sharded.py). The rows never pass through the Dagster step. The torch backend keeps the
policy it loaded resident, so the update that follows skips its load. Log-probs are taken at the rollout's
sampling temperature with the update's padding and micro-batching, so at iteration 0 they equal the rollout
engine's up to its numerics (a test checks 1e-4 on the tiny model).

Their uses, as verl's: the advantage stage's KL in the reward (algorithm.use_kl_in_reward) and the torch
update's PPO ratio denominator, both through the advantages table. The engine-vs-trainer gap
(stages.algos.probs_diff) is stored per rollout (rollout_probs_diff_max, rollout_probs_diff_mean) and
summarized as the iteration's training/rollout_probs_diff_* metrics (stages/iteration_metrics.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from configs.schema import ActorConfig, RunConfig
from stages.algos.probs_diff import (
    merge_probs_diff_moments,
    probs_diff_from_moments,
    probs_diff_moments,
    rollout_probs_diff,
)
from stages.io.stage_exec import Partition
from stages.policy_checkpoint import actor_workers
from stages.train.batching import logprob_temperature, loss_mask, ragged_to_padded, row_masks
from stages.workers.actor_worker import ActorWorker
from stages.workers.placement import CPU_ONLY, GpuPool
from stages.workers.shard_io import ShardResult, Sink
from stages.workers.sharded import local_group, shard_frames, sharded_run

WORKER_COLUMNS = ["rollout_id", "policy_version", "prompt_token_ids", "response_token_ids"]
"""What the workers get of the rollouts (not the texts)."""
READ_COLUMNS = (*WORKER_COLUMNS, "rollout_logprobs", "response_mask")
"""What a rank reads of the rollouts: the workers' columns, and the engine's log-probs and response mask for the
engine-vs-trainer gap it computes on its rows."""


def policy_old_logprobs(
    cfg: RunConfig, rollouts: pd.DataFrame | Partition, policy_dir: str | Path, sink: Sink | None = None
) -> list[ShardResult]:
    """The old_logprobs rows of an iteration's rollouts under policy_dir (policy version == iteration), on the
    actor.num_workers ranks of the "actor" group; with a Partition handle and a sink, each rank reads its slice
    of the rollouts and writes its rows (commit them with stages.workers.sharded.commit_shards)."""
    return old_logprob_shards(
        rollouts,
        policy_dir=str(policy_dir),
        actor=cfg.actor,
        temperature=logprob_temperature(cfg.rollout.temperature),
        gpus=GpuPool.of(cfg.trainer),
        sink=sink,
    )


def old_logprob_shards(
    rollouts: pd.DataFrame | Partition,
    *,
    policy_dir: str,
    actor: ActorConfig,
    temperature: float = 1.0,
    use_ray: bool = True,
    gpus: GpuPool = CPU_ONLY,
    sink: Sink | None = None,
) -> list[ShardResult]:
    """Each rank's old_logprobs rows (rollout_id, policy_version, old_logprobs, rollout_probs_diff_max,
    rollout_probs_diff_mean; sorted by rollout_id, one list per rollout as long as its response) and the gap's
    moments (finish_old_logprobs), in rank order.

    Rank i of the actor group gets the i-th contiguous shard (an empty one when there are fewer rollouts than
    ranks, so every rank holds the policy for the update); use_ray=False computes in this process (an
    ActorWorker at this process's thread count). A killed actor is replaced and the call retried once."""
    if isinstance(rollouts, pd.DataFrame):
        if not len(rollouts):
            raise ValueError("compute_old_logprobs got no rollouts: the rollouts partition is empty")
    return sharded_run(
        lambda: (
            actor_workers(actor, gpus=gpus)
            if use_ray
            else local_group(ActorWorker, torch.get_num_threads(), strategy=actor.strategy)
        ),
        ActorWorker.compute_log_prob,
        rollouts,
        lambda shard: (policy_dir, shard, actor, temperature),
        columns=READ_COLUMNS,
        sink=sink,
        finish=finish_old_logprobs,
        every_rank=True,
    )


def compute_old_logprobs(rollouts: pd.DataFrame, **kwargs) -> pd.DataFrame:
    """old_logprob_shards of rollouts held here (keyword arguments: its), the ranks' rows in rollout_id order."""
    return shard_frames(old_logprob_shards(rollouts, **kwargs)).sort_values("rollout_id").reset_index(drop=True)


def finish_old_logprobs(rows: pd.DataFrame, out: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, float]]:
    """On the rank: its rows of old_logprobs sorted by rollout_id with the per-rollout gap to the engine's
    log-probs (rows: what it read of the rollouts), and the gap's mergeable moments (old_logprobs_gap)."""
    out = out.sort_values("rollout_id").reset_index(drop=True)
    engine, masks = engine_logprobs_and_masks(rows, out["rollout_id"])
    if not (out["old_logprobs"].map(len).to_numpy() == np.asarray([len(e) for e in engine], dtype=np.int64)).all():
        raise AssertionError("old log-probs and response lengths differ: an actor rank returned rows of other rollouts")
    old, rollout, mask = gap_tensors(out["old_logprobs"].tolist(), engine, masks)
    _, row_max, row_mean = rollout_probs_diff(old, rollout, mask)
    moments = probs_diff_moments(old, rollout, mask)
    return out.assign(rollout_probs_diff_max=row_max.numpy(), rollout_probs_diff_mean=row_mean.numpy()), moments


def old_logprobs_gap(results: list[ShardResult]) -> dict[str, float]:
    """verl's five rollout-vs-actor gap metrics over every rank's rows (from their moments)."""
    merged = functools.reduce(merge_probs_diff_moments, [r.summary for r in results])
    return probs_diff_from_moments(merged)


def engine_logprobs_and_masks(rollouts: pd.DataFrame, rollout_ids) -> tuple[list, list[list[int] | None] | None]:
    """(the engine's rollout_logprobs, the response masks (row_masks) or None) of rollout_ids' rollouts, in
    that order."""
    rows = rollouts.set_index("rollout_id").loc[list(rollout_ids)]
    return rows["rollout_logprobs"].tolist(), row_masks(rows.get("response_mask"))


def engine_minus(rollouts: pd.DataFrame, rows: pd.DataFrame, column: str) -> np.ndarray:
    """The engine's log-probs minus `rows[column]` (another model's per-token log-probs of the same rollouts,
    matched by rows["rollout_id"]), concatenated over the tokens the policy sampled (response mask 1): the
    per-token log-ratio whose mean is k1 (ref_logprobs) or the reverse KL to a teacher (teacher_logprobs)."""
    engine, masks = engine_logprobs_and_masks(rollouts, rows["rollout_id"])
    return np.concatenate(
        [
            (np.asarray(a) - np.asarray(b))[np.ones(len(a), bool) if m is None else np.asarray(m, bool)]
            for a, b, m in zip(engine, rows[column], masks or [None] * len(engine), strict=True)
        ]
        or [np.zeros(0)]
    )


def gap_tensors(
    old_logprobs: Sequence[Sequence[float]],
    rollout_logprobs: Sequence[Sequence[float]],
    masks: Sequence[Sequence[int] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N rollouts' ragged log-prob lists (equal lengths per rollout) as (old (N, L), engine (N, L), mask (N, L)):
    every listed token is counted except where the rollout's response mask (masks, row_masks: N 0/1 lists or
    None = all ones) is 0: observation tokens, whose rollout_logprobs are 0.0 placeholders (the engine did not
    sample them)."""
    lengths = [len(x) for x in rollout_logprobs]
    width = max(1, max(lengths)) if lengths else 1
    mask = loss_mask(lengths, width, masks)  # (N, L)
    return ragged_to_padded(old_logprobs, width), ragged_to_padded(rollout_logprobs, width), mask


def probs_gap(
    old_logprobs: Sequence[Sequence[float]],
    rollout_logprobs: Sequence[Sequence[float]],
    masks: Sequence[Sequence[int] | None] | None = None,
) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
    """stages.algos.probs_diff.rollout_probs_diff of N rollouts' ragged log-prob lists (gap_tensors): (verl's five
    metrics, per-rollout max (N,), per-rollout mean (N,))."""
    return rollout_probs_diff(*gap_tensors(old_logprobs, rollout_logprobs, masks))
