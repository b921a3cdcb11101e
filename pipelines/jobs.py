"""Jobs: run set-up (prompts + initial policy) and one RL iteration (a partition of the DAG)."""
from __future__ import annotations

import dagster as dg

from assets.common import iterations

SETUP_JOB = "rlake_setup_job"
ITERATION_JOB = "rl_iteration_job"

# in_process: a run's steps share one process, hence one Ray connection and the persistent workers
# (rollout engine hosts, trainer group) for the whole run; launched from the UI, a multiprocess run
# would start Ray and every worker again in each step (the DAG is a chain, so nothing runs in parallel)
setup_job = dg.define_asset_job(SETUP_JOB, selection=dg.AssetSelection.assets("prompts", "initial_policy"),
                                executor_def=dg.in_process_executor,
                                description="Ingest the dataset and create policy version 0.")
ITERATION_ASSETS = ("prompt_batch", "rollouts", "scored_rollouts", "advantages", "policy_checkpoint",
                    "iteration_metrics")


def iteration_assets(cfg=None) -> list[str]:
    """The iteration job's assets for a RunConfig: the base DAG plus the stages its algorithm needs."""
    names = list(ITERATION_ASSETS)
    if cfg is not None and cfg.algorithm.adv_estimator == "gae":  # PPO with a critic (assets/critic.py)
        names += ["values", "critic_checkpoint"]
    if cfg is not None and (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):  # KL: assets/reference.py
        names.insert(names.index("rollouts") + 1, "ref_logprobs")
    return names


def make_iteration_job(cfg=None) -> dg.UnresolvedAssetJobDefinition:
    """The one-iteration job with the selection `iteration_assets(cfg)` (cfg None: the base DAG)."""
    return dg.define_asset_job(
        ITERATION_JOB, partitions_def=iterations, selection=dg.AssetSelection.assets(*iteration_assets(cfg)),
        executor_def=dg.in_process_executor,
        description="One RL iteration: prompts -> rollouts -> rewards -> advantages -> update -> metrics.")


iteration_job = make_iteration_job()
