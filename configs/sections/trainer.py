"""The `trainer` section: run names, iterations, checkpoints, GPU pool, resume, async mode."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from configs.sections.base import _Strict

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""What a run id (and the experiment name it defaults to) may be."""


class TrainerConfig(_Strict):
    project_name: str = "rlake"
    """MLflow experiment name."""
    experiment_name: str = "tiny_cpu"
    """Run name; the rlake run id defaults to it."""
    run_id: str | None = None
    """Explicit run id; `rlake train` generates one from experiment_name when unset. Letters, digits and
    `._-` (it names a Dagster partition, a checkpoint directory and an MLflow tag)."""
    total_training_steps: int = 10
    """RL iterations."""
    save_freq: int = 1
    """Keep a policy checkpoint every save_freq iterations (the latest is always kept)."""
    test_freq: int = 5
    """Validate every test_freq iterations (and before the first and after the last)."""
    max_ppo_kl: float | None = None
    """Blocking check `ppo_kl_within_limit` on policy_checkpoint: stop the run when an update's
    |actor/ppo_kl| exceeds this (the policy moved too far from the one that sampled); null = off."""
    max_rollout_probs_diff_mean: float | None = 0.02
    """Warn check `rollout_probs_diff_within_limit` on old_logprobs: warn (in the UI; the run goes on) when the
    engine-vs-trainer gap training/rollout_probs_diff_mean (mean |p_engine - p_trainer| over response
    tokens) exceeds this; the fp32 HF engine sits near 1e-5, a growing gap means the engine samples from
    other numerics or other weights than the trainer scores; null = off."""
    n_gpus_per_node: int = 0
    """GPUs per node of the run's GPU pool (verl's name; verl defaults to 8). 0: a CPU run, no worker requests
    a GPU. Else every role is colocated on the pool (verl's hybrid engine, stages/workers/placement.py): rank i
    of each role (actor, rollout, ref, critic, reward model, judge) runs on GPU i, so each role's num_workers
    must be at most n_gpus_per_node x nnodes."""
    nnodes: int = 1
    """Nodes of the GPU pool (verl's name): one STRICT_PACK placement group of n_gpus_per_node GPUs per node."""
    output_dir: str = "rlake_output"
    """Root for Delta tables, checkpoints and the MLflow store."""
    mlflow_tracking_uri: str | None = None
    """Defaults to sqlite:///{output_dir}/mlflow.db."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """verl's resume switch. auto: continue run_id (or --run-id) if it exists, else the newest unfinished
    run of this experiment_name and config under output_dir, else start fresh; disable: always start at
    iteration 0; resume_path: continue from the checkpoint directory resume_from_path."""
    resume_from_path: str | None = None
    """A policy_v<N> checkpoint directory (under output_dir/checkpoints/<run_id>/); used by resume_mode=resume_path."""
    resume_allow_config_change: bool = False
    """Resume even if the checkpoint's trainer_state.json was written under a different config hash."""
    max_iteration_retries: int = Field(2, ge=0)
    """Times `rlake train` re-runs one iteration, from its last committed checkpoint on rebuilt workers, after
    losing a worker (a dead node or actor, a placement group not placed in ray.placement_timeout_s); then it
    exits with the `rlake train --run-id` command that resumes. Other errors stop the run at once. 0: never."""
    async_mode: Literal["sync", "one_step_off"] = "sync"
    """sync: iteration i's rollouts are sampled from policy v_i, then v_i is updated (verl's default trainer).
    one_step_off (verl's one_step_off_policy recipe): iteration i's rollouts are sampled from v_{i-1} (v_0 for
    iterations 0 and 1), so `rlake train` generates iteration i+1's rollouts while iteration i's update runs,
    in two Dagster runs at once. The PPO ratio still uses the trainer's recomputed log-probs of v_i;
    algorithm.rollout_correction adds verl's truncated IS of the engine-vs-trainer gap. Needs the engines and
    the trainer on separate devices, so a CPU run only (n_gpus_per_node: 0)."""

    def rollout_version(self, iteration: int) -> int:
        """The policy version that samples iteration `iteration`'s rollouts (see async_mode)."""
        return max(iteration - self.policy_lag, 0)

    @property
    def tracking_uri(self) -> str:
        """mlflow_tracking_uri, else the sqlite store under output_dir (absolute: the URI works from any cwd)."""
        return self.mlflow_tracking_uri or f"sqlite:///{Path(self.output_dir).resolve() / 'mlflow.db'}"

    @property
    def policy_lag(self) -> int:
        """How many updates the sampling policy trails the trainer by (0: sync, 1: one_step_off)."""
        return 0 if self.async_mode == "sync" else 1

    @model_validator(mode="after")
    def _gpu_pool(self) -> TrainerConfig:
        if self.n_gpus_per_node < 0 or self.nnodes < 1:
            raise ValueError(
                f"trainer.n_gpus_per_node ({self.n_gpus_per_node}) must be >= 0 and trainer.nnodes ({self.nnodes}) "
                ">= 1, because they size the GPU pool (0 GPUs: a CPU run); fix them."
            )
        if self.async_mode == "one_step_off" and self.n_gpus_per_node > 0:
            raise ValueError(
                "trainer.async_mode=one_step_off overlaps generation with the update, so the rollout engines and "
                f"the trainer need devices of their own; with trainer.n_gpus_per_node={self.n_gpus_per_node} rlake "
                "colocates every role on the GPU pool (the engine sleeps during the update), so nothing could "
                "overlap. Use trainer.async_mode=sync on GPUs, or n_gpus_per_node=0 for a CPU run."
            )
        return self

    @model_validator(mode="after")
    def _run_names(self) -> TrainerConfig:
        for key in ("run_id", "experiment_name"):
            value = getattr(self, key)
            if value is not None and not RUN_NAME.fullmatch(value):
                raise ValueError(
                    f"trainer.{key}={value!r} is not a valid run name: it becomes a Dagster partition key, a "
                    "directory name and an MLflow tag, so it may only hold letters, digits, '.', '_' and '-' "
                    "(at most 100, starting with a letter or digit); rename it, e.g. "
                    f"{re.sub(r'[^A-Za-z0-9._-]+', '-', value).strip('-._')[:100] or 'run-1'!r}"
                )
        return self
