"""Run an rlake training run through Dagster in-process: set-up job, then one job run per iteration."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def dagster_home(output_dir: str) -> Path:
    """DAGSTER_HOME if set, else <output_dir>/dagster_home (created), so `rlake ui` shows `rlake train`'s runs."""
    home = Path(os.environ.get("DAGSTER_HOME") or Path(output_dir).resolve() / "dagster_home")
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").touch()
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def run_training(config_path: str, overrides: list[str], *, run_id: str | None = None, steps: int | None = None,
                 log: Callable[[str], None] = print) -> dict:
    """Returns {"run_id", "setup": metadata of initial_policy, "iterations": [metadata of iteration_metrics]}."""
    from configs.schema import load_config

    overrides = list(overrides)
    cfg = load_config(config_path, overrides)  # a bad config fails here, before any work
    run_id = run_id or cfg.trainer.run_id or f"{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides.append(f"trainer.run_id={run_id}")
    cfg = load_config(config_path, overrides)
    dagster_home(cfg.trainer.output_dir)
    import dagster as dg

    from pipelines.definitions import build_definitions
    from pipelines.jobs import ITERATION_JOB, SETUP_JOB

    defs = build_definitions(config_path, overrides)
    instance = dg.DagsterInstance.get()
    out = Path(cfg.trainer.output_dir).resolve()
    log(f"rlake run {run_id}  config {config_path}  hash {cfg.config_hash()}  output {out}")
    t0 = time.perf_counter()
    tags = {"rlake/run_id": run_id}
    result = defs.resolve_job_def(SETUP_JOB).execute_in_process(instance=instance, tags=tags, run_config=QUIET)
    setup = _metadata(result, "initial_policy")
    log(f"setup done in {time.perf_counter() - t0:.1f}s: " + _fmt_items(setup, "val"))
    history = []
    for it in range(cfg.trainer.total_training_steps if steps is None else steps):
        t1 = time.perf_counter()
        instance.add_dynamic_partitions("iteration", [str(it)])
        res = defs.resolve_job_def(ITERATION_JOB).execute_in_process(partition_key=str(it), instance=instance,
                                                                     tags=tags, run_config=QUIET)
        history.append(_metadata(res, "iteration_metrics"))
        log(f"iteration {it}: {time.perf_counter() - t1:.1f}s  " + _fmt_items(history[-1], ""))
    log(f"done: {len(history)} iterations in {time.perf_counter() - t0:.1f}s. Tables: {out / 'tables'}; "
        f"MLflow: {defs.resources['tracker'].tracking_uri} (experiment {cfg.trainer.project_name}, run {run_id})")
    return {"run_id": run_id, "setup": setup, "iterations": history}


def _metadata(result, asset: str) -> dict:
    for event in result.get_asset_materialization_events():
        mat = event.step_materialization_data.materialization
        if mat.asset_key.to_user_string() == asset:
            return {k: v.value for k, v in mat.metadata.items()}
    return {}


def _fmt_items(meta: dict, prefix: str) -> str:
    return "  ".join(f"{k}={_fmt(v)}" for k, v in sorted(meta.items()) if k.startswith(prefix) and k != "delta_version")


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
