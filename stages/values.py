"""The values stage (PPO with GAE): per-token values of each rollout's response under critic version
== iteration, GAE's baseline.

Flow: assets/values.py `materialize` -> `rollout_values(cfg, rollouts, critic_dir, iteration, sink)` ->
`CriticWorker.compute_values` (stages/workers/critic_worker.py) on the run's one-worker "critic" group,
one torch thread, which reads the rollouts partition at its recorded version and writes the rows itself
(stages/workers/sharded.py). The asset passes critic version `iteration` (stages.train.critic.require_critic
creates version 0 from policy version 0 on first use).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from configs.schema import RunConfig
from stages.io.stage_exec import Partition
from stages.workers.critic_worker import CriticWorker
from stages.workers.group import WorkerGroup, ensure_ray_for, worker_group
from stages.workers.placement import GpuPool
from stages.workers.shard_io import ShardResult, Sink
from stages.workers.sharded import sharded_run


def critic_group(cfg: RunConfig) -> WorkerGroup:
    """The run's "critic" group: one CriticWorker on one torch thread, on GPU 0 of a GPU run (connects to Ray
    first if needed)."""
    ensure_ray_for(cfg)
    return worker_group(CriticWorker, "critic", 1, threads=1, gpus=GpuPool.of(cfg.trainer))


READ_COLUMNS = ("rollout_id", "prompt_token_ids", "response_token_ids")
"""What the critic rank reads of the rollouts."""


def rollout_values(
    cfg: RunConfig, rollouts: pd.DataFrame | Partition, critic_dir: str | Path, iteration: int, sink: Sink | None = None
) -> list[ShardResult]:
    """The `values` rows (rollout_id, critic_version, values) of iteration `iteration`'s rollouts and their summary
    (finish_values); with a Partition handle and a sink the critic rank reads the rollouts and writes the rows."""
    return sharded_run(
        lambda: critic_group(cfg),
        CriticWorker.compute_values,
        rollouts,
        lambda shard: (shard, str(critic_dir), iteration, cfg.critic.ppo_micro_batch_size),
        columns=READ_COLUMNS,
        sink=sink,
        finish=finish_values,
    )


def finish_values(rows: pd.DataFrame, out: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, float]]:
    """On the rank: the rows as they are, and {"sum", "n", "non_finite"} of their values (NaN left out of sum and
    n): a NaN value would turn every GAE advantage of the batch into NaN, so the asset checks non_finite."""
    flat = np.concatenate([np.asarray(x, dtype=np.float64) for x in out["values"]] + [np.zeros(0)])
    kept = flat[~np.isnan(flat)]
    return out, {"sum": float(kept.sum()), "n": int(kept.size), "non_finite": int((~np.isfinite(flat)).sum())}
