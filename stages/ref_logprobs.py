"""The ref_logprobs stage: per-token log-probs of every rollout's response under the reference policy
(policy version 0 of the run), for KL as a loss (actor.use_kl_loss) or in the reward
(algorithm.use_kl_in_reward).

Flow: assets/ref_logprobs.py `materialize` -> `reference_logprobs(cfg, rollouts, ref_dir, sink)` ->
`ref_logprob_shards`, which gives each rank of the run's "ref" worker group a contiguous slice of the rollouts
partition at its recorded version; the rank reads it, calls `RefWorker.compute_ref_log_prob`
(stages/workers/ref_worker.py) and writes its rows; the asset commits the files once. The
workers load the reference once and keep it for the whole run. Log-probs are taken at the rollout's
sampling temperature (as verl's ref), so at iteration 0 they equal the rollout engine's (a test checks 1e-4).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from configs.schema import RunConfig
from stages.io.stage_exec import Partition
from stages.old_logprobs import engine_minus
from stages.train.batching import logprob_temperature
from stages.workers.group import engine_threads, worker_group
from stages.workers.placement import CPU_ONLY, GpuPool
from stages.workers.ref_worker import RefWorker
from stages.workers.shard_io import ShardResult, Sink
from stages.workers.sharded import local_group, shard_frames, sharded_run, source_rows
from stages.workers.tasks import MAX_ACTOR_RESTARTS

REF_POLICY_VERSION = 0
"""verl's reference policy is the initial actor; in rlake that is policy version 0 of the run."""


READ_COLUMNS = (
    "rollout_id",
    "policy_version",
    "prompt_token_ids",
    "response_token_ids",
    "response_length",
    "rollout_logprobs",
    "response_mask",
)
"""What a rank reads of the rollouts: the workers' columns, the lengths it checks, and the engine's log-probs and
response mask for the log-ratio summary (finish_ref_logprobs)."""


def reference_logprobs(
    cfg: RunConfig, rollouts: pd.DataFrame | Partition, ref_dir: str | Path, sink: Sink | None = None
) -> list[ShardResult]:
    """The ref_logprobs rows of an iteration's rollouts, on rollout.num_workers "ref" workers (ref_logprob_shards);
    with a Partition handle and a sink, each rank reads its slice and writes its rows."""
    return ref_logprob_shards(
        rollouts,
        model_dir=str(ref_dir),
        micro_batch_size=cfg.actor.ppo_micro_batch_size,
        num_workers=cfg.rollout.num_workers,
        temperature=logprob_temperature(cfg.rollout.temperature),
        param_dtype=cfg.actor.mixed_precision.param_dtype,
        max_token_len=cfg.actor.log_prob_max_token_len_per_gpu if cfg.actor.use_dynamic_bsz else None,
        gpus=GpuPool.of(cfg.trainer),
        sink=sink,
    )


# long: the reference model's settings, each passed through to RefWorker
def ref_logprob_shards(
    rollouts: pd.DataFrame | Partition,
    *,
    model_dir: str,
    micro_batch_size: int = 64,
    num_workers: int = 1,
    use_ray: bool = True,
    temperature: float = 1.0,
    param_dtype: str = "float32",
    max_token_len: int | None = None,
    gpus: GpuPool = CPU_ONLY,
    role: str = "ref",
    sink: Sink | None = None,
    column: str = "ref_logprobs",
) -> list[ShardResult]:
    """Each rank's ref_logprobs rows (rollout_id, policy_version, ref_policy_version, ref_logprobs; sorted by
    rollout_id, one list per rollout as long as its response) and its log-ratio sums (finish_ref_logprobs), in rank
    order. `column`: the output's name for the log-probs (the teacher's: teacher_logprobs, without
    ref_policy_version).

    param_dtype: the forward's compute dtype (the actor's, so KL terms compare like with like). role: the worker
    group (the distillation teacher's is "teacher", stages/teacher_logprobs.py).
    use_ray=False computes in this process (a RefWorker at this process's thread count); a killed ref
    worker is replaced and the call retried up to MAX_ACTOR_RESTARTS times. max_token_len: packed micro-batches of
    at most that many tokens (actor.use_dynamic_bsz, RefWorker); None: micro_batch_size padded rollouts."""
    kwargs = {
        "model_dir": model_dir,
        "ref_policy_version": REF_POLICY_VERSION,
        "micro_batch_size": micro_batch_size,
        "temperature": temperature,
        "param_dtype": param_dtype,
        "max_token_len": max_token_len,
    }
    if isinstance(rollouts, pd.DataFrame):
        if not len(rollouts):
            raise ValueError("compute_ref_logprobs got no rollouts: the rollouts partition is empty")
    workers = max(1, min(num_workers, source_rows(rollouts)))
    return sharded_run(
        lambda: (
            worker_group(RefWorker, role, workers, threads=engine_threads(workers), gpus=gpus, **kwargs)
            if use_ray
            else local_group(RefWorker, torch.get_num_threads(), **kwargs)
        ),
        RefWorker.compute_ref_log_prob,
        rollouts,
        lambda shard: (shard,),
        columns=READ_COLUMNS,
        sink=sink,
        finish=functools.partial(finish_ref_logprobs, column=column),
        retries=MAX_ACTOR_RESTARTS,
    )


def compute_ref_logprobs(rollouts: pd.DataFrame, **kwargs) -> pd.DataFrame:
    """ref_logprob_shards of rollouts held here (keyword arguments: its), the ranks' rows in rollout_id order."""
    return shard_frames(ref_logprob_shards(rollouts, **kwargs)).sort_values("rollout_id").reset_index(drop=True)


def finish_ref_logprobs(
    rows: pd.DataFrame, out: pd.DataFrame, *, column: str = "ref_logprobs"
) -> tuple[pd.DataFrame, dict[str, float]]:
    """On the rank: its rows sorted by rollout_id (the log-probs renamed to `column`; teacher_logprobs drops
    ref_policy_version), after checking each list is as long as its response, and {"sum", "n"} of the engine's
    log-probs minus these over the sampled tokens (mean_log_ratio: k1 for the reference, the reverse KL for a
    teacher)."""
    out = out.sort_values("rollout_id").reset_index(drop=True)
    lengths = rows.set_index("rollout_id").loc[out["rollout_id"], "response_length"].to_numpy()
    if not (out["ref_logprobs"].map(len).to_numpy() == np.asarray(lengths)).all():
        raise AssertionError("ref log-probs and response lengths differ: a ref worker returned rows of other rollouts")
    if column != "ref_logprobs":
        out = out.drop(columns="ref_policy_version").rename(columns={"ref_logprobs": column})
    if "rollout_logprobs" not in rows.columns:  # rows without the engine's log-probs (a test's): no ratio
        return out, {"sum": 0.0, "n": 0}
    ratio = engine_minus(rows, out, column)  # over the model's own tokens (observation tokens: placeholders)
    return out, {"sum": float(ratio.sum()), "n": int(ratio.size)}


def mean_log_ratio(results: list[ShardResult]) -> float:
    """The mean over every rank's sampled tokens of the engine's log-prob minus the model's (0 with none)."""
    n = sum(r.summary["n"] for r in results)
    return sum(r.summary["sum"] for r in results) / n if n else 0.0
