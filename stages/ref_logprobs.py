"""The ref_logprobs stage: per-token log-probs of every rollout's response under the reference policy
(policy version 0 of the run), for KL as a loss (actor.use_kl_loss) or in the reward
(algorithm.use_kl_in_reward).

Flow: assets/reference.py `ref_logprobs` -> `reference_logprobs(cfg, rollouts, ref_dir)` ->
`compute_ref_logprobs`, which splits the rollouts into contiguous shards over the run's "ref" worker
group and calls `RefWorker.compute_ref_log_prob` (stages/workers/ref_worker.py) on each rank. The
workers load the reference once and keep it for the whole run. Log-probs are taken at the rollout's
sampling temperature (as verl's ref), so at iteration 0 they equal the rollout engine's (a test checks 1e-4).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from configs.schema import RunConfig
from stages.train.batching import logprob_temperature
from stages.workers.group import engine_threads, worker_group
from stages.workers.placement import CPU_ONLY, GpuPool
from stages.workers.ref_worker import RefWorker
from stages.workers.sharded import local_group, sharded_call
from stages.workers.tasks import MAX_ACTOR_RESTARTS

REF_POLICY_VERSION = 0
"""verl's reference policy is the initial actor; in rlake that is policy version 0 of the run."""


def reference_logprobs(cfg: RunConfig, rollouts: pd.DataFrame, ref_dir: str | Path) -> pd.DataFrame:
    """The ref_logprobs table rows of an iteration's rollouts, on rollout.num_workers "ref" workers."""
    return compute_ref_logprobs(
        rollouts,
        model_dir=str(ref_dir),
        micro_batch_size=cfg.actor.ppo_micro_batch_size,
        num_workers=cfg.rollout.num_workers,
        temperature=logprob_temperature(cfg.rollout.temperature),
        param_dtype=cfg.actor.mixed_precision.param_dtype,
        max_token_len=cfg.actor.log_prob_max_token_len_per_gpu if cfg.actor.use_dynamic_bsz else None,
        gpus=GpuPool.of(cfg.trainer),
    )


def compute_ref_logprobs(
    rollouts: pd.DataFrame,
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
) -> pd.DataFrame:
    """Rows of the ref_logprobs table (rollout_id, policy_version, ref_policy_version, ref_logprobs),
    sorted by rollout_id; one list per rollout, as long as its response.

    param_dtype: the forward's compute dtype (the actor's, so KL terms compare like with like). role: the worker
    group (the distillation teacher's is "teacher", stages/teacher_logprobs.py).
    use_ray=False computes in this process (a RefWorker at this process's thread count); a killed ref
    worker is replaced and the call retried up to MAX_ACTOR_RESTARTS times. max_token_len: packed micro-batches of
    at most that many tokens (actor.use_dynamic_bsz, RefWorker); None: micro_batch_size padded rollouts."""
    if not len(rollouts):
        raise ValueError("compute_ref_logprobs got no rollouts: the rollouts partition is empty")
    kwargs = {
        "model_dir": model_dir,
        "ref_policy_version": REF_POLICY_VERSION,
        "micro_batch_size": micro_batch_size,
        "temperature": temperature,
        "param_dtype": param_dtype,
        "max_token_len": max_token_len,
    }
    workers = max(1, min(num_workers, len(rollouts)))
    out = sharded_call(
        lambda: (
            worker_group(RefWorker, role, workers, threads=engine_threads(workers), gpus=gpus, **kwargs)
            if use_ray
            else local_group(RefWorker, torch.get_num_threads(), **kwargs)
        ),
        RefWorker.compute_ref_log_prob,
        rollouts,
        lambda shard: (shard,),
        retries=MAX_ACTOR_RESTARTS,
    )
    out = out.sort_values("rollout_id").reset_index(drop=True)
    lengths = rollouts.set_index("rollout_id").loc[out["rollout_id"], "response_length"].to_numpy()
    if not (out["ref_logprobs"].map(len).to_numpy() == np.asarray(lengths)).all():
        raise AssertionError("ref log-probs and response lengths differ: a ref worker returned rows of other rollouts")
    return out
