"""The one Definitions of rlake. `dagster dev` (workspace.yaml) loads `defs` from here.

RLAKE_CONFIG picks the run config (default configs/tiny_cpu.yaml), RL_ENV the resource set
("local" or "ci"); `rlake train` builds its own with `build_definitions(config, overrides)`.
"""
from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from assets.critic import critic_checkpoint, values
from assets.ingest import initial_policy, prompts
from assets.reference import ref_logprobs
from assets.rollout import prompt_batch, rollouts
from assets.scoring import advantages, scored_rollouts
from assets.training import iteration_metrics, policy_checkpoint
from configs.schema import load_config
from pipelines.jobs import make_iteration_job, setup_job
from pipelines.resources import build_resources
from pipelines.sensors import make_next_iteration_sensor

ROOT = Path(__file__).resolve().parent.parent
ASSETS = [prompts, initial_policy, prompt_batch, rollouts, scored_rollouts, advantages, policy_checkpoint,
          iteration_metrics, values, critic_checkpoint, ref_logprobs]
CONFIG_BY_ENV = {"local": "configs/tiny_cpu.yaml", "ci": "configs/ci_tiny.yaml"}


def build_definitions(config_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dg.Definitions:
    cfg = load_config(config_path, list(overrides))
    iteration_job = make_iteration_job(cfg)
    return dg.Definitions(assets=ASSETS, jobs=[setup_job, iteration_job],
                          sensors=[make_next_iteration_sensor(cfg.trainer.total_training_steps, iteration_job)],
                          resources=build_resources(str(config_path), list(overrides)))


def _default_config() -> str:
    env = os.getenv("RL_ENV", "local")
    if env not in CONFIG_BY_ENV:
        raise ValueError(f"RL_ENV='{env}' is not a known environment. Valid: {sorted(CONFIG_BY_ENV)}")
    return os.getenv("RLAKE_CONFIG", str(ROOT / CONFIG_BY_ENV[env]))


defs = build_definitions(_default_config(), [o for o in os.getenv("RLAKE_OVERRIDES", "").split(";") if o])
