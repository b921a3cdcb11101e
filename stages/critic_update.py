"""The critic_checkpoint stage (PPO with GAE): critic version N trained towards iteration N's GAE returns
(clipped value loss), written as version N+1.

Flow: assets/critic.py `critic_checkpoint` -> `train_critic(cfg, iteration, advantages, values, ...)` ->
`critic_update_request` -> `CriticWorker.update_critic` (stages/workers/critic_worker.py) on the run's
one-worker "critic" group (stages.values.critic_group).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from configs.schema import RunConfig
from stages import seeds
from stages.values import critic_group
from stages.workers.critic_worker import CriticWorker
from stages.workers.group import call_with_retry
from stages.workers.requests import CriticUpdateRequest


def critic_update_request(
    cfg: RunConfig, iteration: int, *, critic_dir: str | Path, out_dir: str | Path
) -> CriticUpdateRequest:
    """Iteration `iteration`'s critic update: critic_dir (version iteration) -> out_dir (version iteration + 1)."""
    return CriticUpdateRequest(
        iteration=iteration,
        critic_dir=str(critic_dir),
        out_dir=str(out_dir),
        critic=cfg.trainer_role(cfg.critic),
        n_per_prompt=cfg.rollout.n,
        seed=seeds.update(cfg.seed, iteration),
    )


def train_critic(
    cfg: RunConfig,
    iteration: int,
    advantages: pd.DataFrame,
    values: pd.DataFrame,
    *,
    critic_dir: str | Path,
    out_dir: str | Path,
) -> dict[str, float]:
    """Update the critic on the iteration's advantages (returns) and values tables; returns its metrics
    (critic/vf_loss, critic/vf_clipfrac, ..., timing_s/critic_update), also stored beside the new version."""
    req = critic_update_request(cfg, iteration, critic_dir=critic_dir, out_dir=out_dir)
    return call_with_retry(
        lambda: critic_group(cfg), lambda g: g.call(CriticWorker.update_critic, req, advantages, values)
    )[0]
