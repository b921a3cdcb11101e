"""Jobs: run set-up (prompts + initial policy) and one RL iteration (a partition of the DAG)."""
from __future__ import annotations

import dagster as dg

from assets.common import iterations

SETUP_JOB = "rlake_setup_job"
ITERATION_JOB = "rl_iteration_job"

setup_job = dg.define_asset_job(SETUP_JOB, selection=dg.AssetSelection.assets("prompts", "initial_policy"),
                                description="Ingest the dataset and create policy version 0.")
iteration_job = dg.define_asset_job(
    ITERATION_JOB, partitions_def=iterations,
    selection=dg.AssetSelection.assets("prompt_batch", "rollouts", "scored_rollouts", "advantages",
                                       "policy_checkpoint", "iteration_metrics"),
    description="One RL iteration: prompts -> rollouts -> rewards -> advantages -> update -> metrics.")
