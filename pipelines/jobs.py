"""Jobs: run set-up (prompts + initial policy, partition = run) and one RL iteration (partition = run x
iteration) of the DAG of stages/dag.py.

The iteration job holds every iteration stage. What a launch runs follows the config it was launched
with, not the one the code location loaded: `rlake train` and the chaining sensor select exactly the
stages of the launched config (`iteration_assets(cfg)`); a launch of the whole job from the launchpad runs
every asset, and a stage the launched config does not use writes nothing (assets/common.py outside_dag).
"""

from __future__ import annotations

import dagster as dg

from assets.common import run_iterations, runs
from configs.schema import RunConfig
from stages.dag import ITERATION, SETUP, iteration_stages

SETUP_JOB = "rlake_setup_job"
ITERATION_JOB = "rl_iteration_job"

# in_process: a run's steps share one process, hence one Ray connection and the persistent workers
# (rollout engine hosts, trainer group) for the whole run; launched from the UI, a multiprocess run
# would start Ray and every worker again in each step (the DAG is a chain, so nothing runs in parallel)
setup_job = dg.define_asset_job(
    SETUP_JOB,
    selection=dg.AssetSelection.assets(*(s.name for s in SETUP)),
    partitions_def=runs,
    executor_def=dg.in_process_executor,
    description="Ingest the dataset and create policy version 0 of the run named by the partition.",
)

iteration_job = dg.define_asset_job(
    ITERATION_JOB,
    partitions_def=run_iterations,
    selection=dg.AssetSelection.assets(*(s.name for s in ITERATION)),
    executor_def=dg.in_process_executor,
    description="One RL iteration of one run: prompts -> rollouts -> rewards -> advantages -> update -> metrics.",
)


def iteration_assets(cfg: RunConfig | None = None) -> list[str]:
    """The assets an iteration of a run with `cfg` materializes: the stages of stages/dag.py ITERATION whose
    `when` holds (cfg None: the stages every run has)."""
    return iteration_stages(cfg)


def iteration_asset_keys(cfg: RunConfig) -> list[dg.AssetKey]:
    """iteration_assets(cfg) as the asset selection of a launch (rlake train, the sensor)."""
    return [dg.AssetKey(name) for name in iteration_stages(cfg)]
