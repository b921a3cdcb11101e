"""The values stage (PPO with GAE): per-token values of each rollout's response under critic version
== iteration, GAE's baseline.

Flow: assets/critic.py `values` -> `rollout_values(cfg, rollouts, critic_dir, iteration)` ->
`CriticWorker.compute_values` (stages/workers/critic_worker.py) on the run's one-worker "critic" group,
one torch thread. The asset passes critic version `iteration` (stages.train.critic.require_critic
creates version 0 from policy version 0 on first use).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from configs.schema import RunConfig
from stages.workers.critic_worker import CriticWorker
from stages.workers.group import WorkerGroup, call_with_retry, ensure_ray_for, worker_group
from stages.workers.placement import GpuPool


def critic_group(cfg: RunConfig) -> WorkerGroup:
    """The run's "critic" group: one CriticWorker on one torch thread, on GPU 0 of a GPU run (connects to Ray
    first if needed)."""
    ensure_ray_for(cfg)
    return worker_group(CriticWorker, "critic", 1, threads=1, gpus=GpuPool.of(cfg.trainer))


def rollout_values(cfg: RunConfig, rollouts: pd.DataFrame, critic_dir: str | Path, iteration: int) -> pd.DataFrame:
    """Rows of the `values` table (rollout_id, critic_version, values) of iteration `iteration`'s rollouts."""
    return call_with_retry(
        lambda: critic_group(cfg),
        lambda g: g.call(
            CriticWorker.compute_values, rollouts, str(critic_dir), iteration, cfg.critic.ppo_micro_batch_size
        ),
    )[0]
