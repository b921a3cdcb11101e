"""The critic_checkpoint stage (PPO with GAE): critic version N trained towards iteration N's GAE returns
(clipped value loss), written as version N+1.

Flow: assets/critic_checkpoint.py `materialize` -> `train_critic(cfg, iteration, advantages, values, ...)` (the two
partitions as handles at their recorded versions) -> `critic_update_request` -> `CriticUpdateRequest` ->
`CriticWorker.update_critic` (stages/workers/critic_worker.py) on the run's one-worker "critic" group
(stages.values.critic_group), which reads the rows itself.
"""

from __future__ import annotations

from pathlib import Path

from configs.schema import RunConfig
from stages import seeds
from stages.io.stage_exec import Partition
from stages.values import critic_group
from stages.workers.critic_worker import CriticWorker
from stages.workers.group import call_with_retry
from stages.workers.requests import CriticUpdateRequest


def critic_update_request(
    cfg: RunConfig,
    iteration: int,
    *,
    critic_dir: str | Path,
    out_dir: str | Path,
    advantages: Partition,
    values: Partition,
) -> CriticUpdateRequest:
    """Iteration `iteration`'s critic update: critic_dir (version iteration) -> out_dir (version iteration + 1),
    on the advantages and values partitions at their recorded versions (handles: the critic rank reads them)."""
    return CriticUpdateRequest(
        iteration=iteration,
        critic_dir=str(critic_dir),
        out_dir=str(out_dir),
        critic=cfg.trainer_role(cfg.critic),
        n_per_prompt=cfg.rollout.n,
        seed=seeds.update(cfg.seed, iteration),
        run_id=cfg.run_id,
        advantages_uri=advantages.uri,
        advantages_version=int(advantages.version),
        values_uri=values.uri,
        values_version=int(values.version),
    )


def train_critic(
    cfg: RunConfig,
    iteration: int,
    advantages: Partition,
    values: Partition,
    *,
    critic_dir: str | Path,
    out_dir: str | Path,
) -> dict[str, float]:
    """Update the critic on the iteration's advantages (returns) and values partitions, which its rank reads; returns
    its metrics (critic/vf_loss, critic/vf_clipfrac, ..., timing_s/critic_update), also stored beside the new
    version."""
    req = critic_update_request(
        cfg, iteration, critic_dir=critic_dir, out_dir=out_dir, advantages=advantages, values=values
    )
    return call_with_retry(lambda: critic_group(cfg), lambda g: g.call(CriticWorker.update_critic, req))[0]
