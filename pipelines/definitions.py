"""The one Definitions of rlake: `build_definitions(cfg)` for a RunConfig; `defs` for `dagster dev`.

Importing this module builds nothing. `rlake train` calls `build_definitions` with the RunConfig it
parsed; `dagster dev` / `rlake ui` (workspace.yaml) load `defs`, a lazy `@dg.definitions` function whose
launch-time default config is RLAKE_CONFIG (default by RL_ENV: "local" configs/tiny_cpu.yaml, "ci"
configs/ci_tiny.yaml) plus RLAKE_OVERRIDES (a JSON list, or `key.sub=value;key=value`), validated once at load. The
Definitions do not depend on that config: every run uses the config it was launched with (the launchpad's
resources.run_config), and the sensor carries it to the next iteration.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import dagster as dg

from assets.stage_assets import stage_assets
from configs.schema import RunConfig, load_config
from pipelines.jobs import iteration_job, setup_job
from pipelines.maintenance import lake_maintenance, lake_maintenance_schedule
from pipelines.resources import build_resources, launch_defaults
from pipelines.sensors import make_next_iteration_sensor

ROOT = Path(__file__).resolve().parent.parent
CONFIG_BY_ENV = {"local": "configs/tiny_cpu.yaml", "ci": "configs/ci_tiny.yaml"}


ASSETS = stage_assets()
"""One asset per row of stages/dag.py, in its order, generated from the row (assets/stage_assets.py)."""


def build_definitions(
    cfg: RunConfig | None = None, *, config_path: str = "", overrides: list[str] | tuple[str, ...] = ()
) -> dg.Definitions:
    """Assets, the set-up, iteration and lake_maintenance jobs (its schedule stopped), the chaining sensor and the
    resources; the run_config resource's launch-time default is `cfg` (resolved), else `config_path` + `overrides`."""
    return dg.Definitions(
        assets=ASSETS,
        jobs=[setup_job, iteration_job, lake_maintenance],
        schedules=[lake_maintenance_schedule],
        sensors=[make_next_iteration_sensor(launch_defaults(cfg, config_path, overrides), iteration_job)],
        resources=build_resources(cfg, config_path=config_path, overrides=overrides),
    )


def ui_source() -> tuple[str, list[str]]:
    """The `dagster dev` code location's default config: (RLAKE_CONFIG or RL_ENV's default, RLAKE_OVERRIDES)."""
    env = os.getenv("RL_ENV", "local")
    if env not in CONFIG_BY_ENV:
        raise ValueError(f"RL_ENV='{env}' is not a known environment. Valid: {sorted(CONFIG_BY_ENV)}")
    path = os.getenv("RLAKE_CONFIG", str(ROOT / CONFIG_BY_ENV[env]))
    return str(Path(path).resolve()), parse_overrides(os.getenv("RLAKE_OVERRIDES", ""))


def parse_overrides(text: str) -> list[str]:
    """RLAKE_OVERRIDES: a JSON list of `key.sub=value` strings (what `rlake ui` passes: a value may hold ';'), or
    `key.sub=value;key=value`."""
    if text.lstrip().startswith("["):
        items = json.loads(text)
        if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
            raise ValueError(f"RLAKE_OVERRIDES {text!r} must be a JSON list of key.sub=value strings")
        return items
    return [o for o in text.split(";") if o]


def ui_config() -> RunConfig:
    """The RunConfig of the `dagster dev` code location's default (ui_source), validated."""
    path, overrides = ui_source()
    return load_config(path, overrides)


@dg.definitions
def defs() -> dg.Definitions:
    """What `dagster dev -w workspace.yaml` loads (each code-server and run process calls it once); a broken
    default config fails the code location's load, not a run."""
    ui_config()
    path, overrides = ui_source()
    return build_definitions(config_path=path, overrides=overrides)
