"""Jobs: run set-up (prompts + initial policy) and one RL iteration (a partition of the DAG, stages/dag.py)."""

from __future__ import annotations

import dagster as dg

from assets.common import iterations
from configs.schema import RunConfig
from stages.dag import SETUP, iteration_stages

SETUP_JOB = "rlake_setup_job"
ITERATION_JOB = "rl_iteration_job"

# in_process: a run's steps share one process, hence one Ray connection and the persistent workers
# (rollout engine hosts, trainer group) for the whole run; launched from the UI, a multiprocess run
# would start Ray and every worker again in each step (the DAG is a chain, so nothing runs in parallel)
setup_job = dg.define_asset_job(
    SETUP_JOB,
    selection=dg.AssetSelection.assets(*(s.name for s in SETUP)),
    executor_def=dg.in_process_executor,
    description="Ingest the dataset and create policy version 0.",
)


def iteration_assets(cfg: RunConfig | None = None) -> list[str]:
    """The iteration job's assets for a RunConfig: the stages of stages/dag.py ITERATION whose `when` holds
    (cfg None: the stages every run has)."""
    return iteration_stages(cfg)


def make_iteration_job(cfg: RunConfig | None = None) -> dg.UnresolvedAssetJobDefinition:
    """The one-iteration job with the selection `iteration_assets(cfg)` (cfg None: the base DAG)."""
    return dg.define_asset_job(
        ITERATION_JOB,
        partitions_def=iterations,
        selection=dg.AssetSelection.assets(*iteration_assets(cfg)),
        executor_def=dg.in_process_executor,
        description="One RL iteration: prompts -> rollouts -> rewards -> advantages -> update -> metrics.",
    )


iteration_job = make_iteration_job()
