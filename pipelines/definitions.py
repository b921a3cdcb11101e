"""The one Definitions of rlake: `build_definitions(cfg)` for a RunConfig; `defs` for `dagster dev`.

Importing this module builds nothing. `rlake train` calls `build_definitions` with the RunConfig it
parsed; `dagster dev` / `rlake ui` (workspace.yaml) load `defs`, a lazy `@dg.definitions` function that
parses the config of the UI's code location once: RLAKE_CONFIG (default by RL_ENV: "local"
configs/tiny_cpu.yaml, "ci" configs/ci_tiny.yaml) plus RLAKE_OVERRIDES (`key.sub=value;key=value`).
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from assets import critic, ingest, judge, old_logprobs, reference, rollout, scoring, training
from configs.schema import RunConfig, load_config
from pipelines.jobs import make_iteration_job, setup_job
from pipelines.resources import build_resources
from pipelines.sensors import make_next_iteration_sensor
from stages.dag import ITERATION, SETUP

ROOT = Path(__file__).resolve().parent.parent
CONFIG_BY_ENV = {"local": "configs/tiny_cpu.yaml", "ci": "configs/ci_tiny.yaml"}


def _assets_in_dag_order() -> list[dg.AssetsDefinition]:
    """The assets of the asset modules, one per stage of stages/dag.py, in its order."""
    found = {
        a.key.to_user_string(): a
        for a in dg.load_assets_from_modules(
            [ingest, rollout, reference, old_logprobs, judge, scoring, critic, training]
        )
    }
    names = [s.name for s in SETUP + ITERATION]
    if set(found) != set(names):
        raise ValueError(
            f"the asset modules define {sorted(found)}, but stages/dag.py lists {sorted(names)}: "
            "every asset is a row of SETUP or ITERATION there (and every row an asset); add or "
            "rename the row or the asset."
        )
    return [found[n] for n in names]


ASSETS = _assets_in_dag_order()


def build_definitions(cfg: RunConfig) -> dg.Definitions:
    """Assets, jobs (the iteration job selects the stages `cfg` has), the chaining sensor and the resources
    of run `cfg`."""
    iteration_job = make_iteration_job(cfg)
    return dg.Definitions(
        assets=ASSETS,
        jobs=[setup_job, iteration_job],
        sensors=[make_next_iteration_sensor(cfg.trainer.total_training_steps, iteration_job)],
        resources=build_resources(cfg),
    )


def ui_config() -> RunConfig:
    """The RunConfig of the `dagster dev` code location: RLAKE_CONFIG (or RL_ENV's default) + RLAKE_OVERRIDES."""
    env = os.getenv("RL_ENV", "local")
    if env not in CONFIG_BY_ENV:
        raise ValueError(f"RL_ENV='{env}' is not a known environment. Valid: {sorted(CONFIG_BY_ENV)}")
    path = os.getenv("RLAKE_CONFIG", str(ROOT / CONFIG_BY_ENV[env]))
    return load_config(path, [o for o in os.getenv("RLAKE_OVERRIDES", "").split(";") if o])


@dg.definitions
def defs() -> dg.Definitions:
    """What `dagster dev -w workspace.yaml` loads (each code-server and run process calls it once)."""
    return build_definitions(ui_config())
