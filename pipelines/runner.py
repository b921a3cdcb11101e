"""Run an rlake training run through Dagster in-process: set-up job, then one job run per iteration.

The runner only sequences jobs: everything a run leaves behind (tables, checkpoints, each checkpoint's
trainer_state.json, MLflow metrics) is written by the assets, so an iteration launched from the Dagster
UI leaves the same files as one run by `rlake train`. Each job run is launched like a UI launch: on the
run's partition (run, or run x iteration), with the resolved config as the run_config resource's launch
config (so the Dagster run records it), and the stages of that config.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import dagster as dg

from assets.common import add_partitions, partition_key
from configs.errors import load_run_config
from configs.schema import RunConfig
from pipelines.definitions import build_definitions
from pipelines.jobs import ITERATION_JOB, SETUP_JOB, iteration_asset_keys
from pipelines.progress import RunProgress, plain
from pipelines.resources import tables_root, tracker_for
from pipelines.sensors import DRIVER_TAG
from stages.io.checkpoints import ModelStore
from stages.run.preflight import preflight
from stages.run.resume import ResumePlan, plan_resume

QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
TELEMETRY_OFF = "telemetry:\n  enabled: false\n"


def dagster_home(output_dir: str) -> Path:
    """DAGSTER_HOME if set, else <output_dir>/dagster_home (created), so `rlake ui` shows `rlake train`'s runs.

    Its dagster.yaml switches Dagster's telemetry (and the banner it prints on first use) off, unless the
    file already says something about telemetry."""
    home = Path(os.environ.get("DAGSTER_HOME") or Path(output_dir).resolve() / "dagster_home")
    home.mkdir(parents=True, exist_ok=True)
    conf = home / "dagster.yaml"
    text = conf.read_text() if conf.is_file() else ""
    if "telemetry" not in text:
        conf.write_text(text + ("\n" if text and not text.endswith("\n") else "") + TELEMETRY_OFF)
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def launch_config(cfg: RunConfig) -> dict:
    """The Dagster run config of a run of `cfg`: quiet console logs and the resolved config as the run_config
    resource's launch config (what the run's page in the UI shows)."""
    return {**QUIET, "resources": {"run_config": {"config": {"config_json": cfg.model_dump_json()}}}}


def run_training(
    config: RunConfig | str | Path,
    overrides: Sequence[str] = (),
    *,
    run_id: str | None = None,
    steps: int | None = None,
    log: Callable[[str], None] = print,
    progress: RunProgress | None = None,
) -> dict:
    """Train run `config`: a RunConfig (what `rlake train` passes: parsed once), or a YAML path plus
    `key.sub=value` overrides, parsed here. Returns {"run_id", "setup": metadata of initial_policy,
    "iterations": [metadata of iteration_metrics], "start_iteration", "resume"}.

    `progress` shows what is running (pipelines/progress.py); without one, plain lines go to `log`.
    The MLflow run is marked FINISHED by the last iteration, FAILED when an iteration raises and KILLED
    on Ctrl-C, so no run stays RUNNING in the MLflow UI."""
    progress = progress or plain(log)
    cfg = _resolve(config, overrides, progress)  # a bad config fails here, before any work
    progress.phase("preflight", "data and model inputs")
    preflight(cfg)  # bad data / model input fails here, before warm-start or Ray
    plan = plan_resume(cfg, run_id or cfg.trainer.run_id, steps)
    cfg = cfg.with_run_id(plan.run_id or f"{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    dagster_home(cfg.trainer.output_dir)
    progress.phase("dagster", "instance and definitions")
    defs = build_definitions(cfg)
    instance = dg.DagsterInstance.get()
    _start(cfg, plan, instance, progress)
    tracker = tracker_for(cfg)
    t0 = time.perf_counter()
    try:
        setup, history = _run_jobs(defs, instance, cfg, plan, steps, progress)
    except KeyboardInterrupt:
        _end_mlflow_run(tracker, cfg.run_id, "KILLED", progress)
        raise
    except BaseException:
        _end_mlflow_run(tracker, cfg.run_id, "FAILED", progress)
        raise
    _end_mlflow_run(tracker, cfg.run_id, "FINISHED", progress)  # also a --steps stop short of the last iteration
    progress.line(
        f"done: {len(history)} iterations in {time.perf_counter() - t0:.1f}s. Tables: {tables_root(cfg)}; "
        f"MLflow: {tracker.tracking_uri} (experiment {cfg.trainer.project_name}, run {cfg.run_id})"
    )
    return {
        "run_id": cfg.run_id,
        "setup": setup,
        "iterations": history,
        "start_iteration": plan.start_iteration,
        "resume": plan.reason,
    }


def _resolve(config: RunConfig | str | Path, overrides: Sequence[str], progress: RunProgress) -> RunConfig:
    """`config` itself, or the RunConfig of YAML path `config` with `overrides`."""
    if not isinstance(config, RunConfig):
        progress.phase("config", str(config))
        return load_run_config(config, overrides)
    if overrides:
        raise ValueError(
            f"run_training got a RunConfig and overrides {list(overrides)}: overrides apply to a "
            "YAML path; pass the path, or apply them with configs.errors.load_run_config first."
        )
    return config


def _start(cfg: RunConfig, plan: ResumePlan, instance: dg.DagsterInstance, progress: RunProgress) -> None:
    """Say what runs, and clear what a killed earlier process of this run left: partial checkpoint writes
    and Dagster runs still marked as running."""
    out = Path(cfg.trainer.output_dir).resolve()
    progress.line(f"rlake run {cfg.run_id}  config hash {cfg.config_hash()}  output {out}")
    progress.line(plan.reason)
    partial = ModelStore(out / "checkpoints", cfg.run_id).remove_partial()
    if partial:
        progress.line(f"removed partial checkpoint writes of a killed run: {partial}")
    stale = _fail_stale_runs(instance, cfg.run_id)
    if stale:
        progress.line(f"marked {len(stale)} Dagster run(s) of a killed process as failed: {stale}")


def _run_jobs(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    cfg: RunConfig,
    plan: ResumePlan,
    steps: int | None,
    progress: RunProgress,
) -> tuple[dict, list[dict]]:
    """The set-up job (when the plan says so), then one iteration job per iteration up to `steps`
    (default trainer.total_training_steps); returns (initial_policy's metadata, iteration_metrics' per iteration)."""
    tags = {"rlake/run_id": cfg.run_id, DRIVER_TAG: "cli", "rlake/config_hash": cfg.config_hash()}
    run_config = launch_config(cfg)
    setup: dict = {}
    history = []
    add_partitions(instance, cfg.run_id)
    if plan.run_setup:
        t0 = time.perf_counter()
        job = defs.resolve_job_def(SETUP_JOB)
        res = _execute(job, instance, progress, tags=tags, run_config=run_config, partition=cfg.run_id)
        setup = _metadata(res, "initial_policy")
        progress.line(f"setup done in {time.perf_counter() - t0:.1f}s: " + _fmt_items(setup, "val"))
    total = cfg.trainer.total_training_steps if steps is None else steps
    progress.start_iterations(plan.start_iteration, total)
    for it in range(plan.start_iteration, total):
        t1 = time.perf_counter()
        add_partitions(instance, cfg.run_id, it)
        res = _execute(
            defs.resolve_job_def(ITERATION_JOB),
            instance,
            progress,
            tags=tags,
            run_config=run_config,
            partition=partition_key(cfg.run_id, it),
            asset_selection=iteration_asset_keys(cfg),
        )
        history.append(_metadata(res, "iteration_metrics"))
        progress.iteration_done(it, time.perf_counter() - t1, _fmt_items(history[-1], ""))
    return setup, history


def _end_mlflow_run(tracker, run_id: str, status: str, progress: RunProgress) -> None:
    """Mark the MLflow run ended without hiding the error that ended it."""
    try:
        tracker.end_run(run_id, status)
    except Exception as exc:  # the store itself may be what failed
        progress.line(f"could not mark MLflow run {run_id} {status}: {exc}")


def _execute(
    job, instance, progress: RunProgress, *, tags: dict, run_config: dict, partition: str, asset_selection=None
):
    """One in-process Dagster run of one partition, its steps shown by `progress` as they start."""
    dagster_run_id = str(uuid.uuid4())
    with progress.follow(instance, dagster_run_id):
        return job.execute_in_process(
            instance=instance,
            tags=tags,
            run_config=run_config,
            partition_key=partition,
            asset_selection=asset_selection,
            run_id=dagster_run_id,
        )


def _fail_stale_runs(instance, run_id: str) -> list[str]:
    """Dagster runs of this rlake run still STARTED/STARTING: their process was killed (runs are in-process)."""
    statuses = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING]
    stale = instance.get_runs(filters=dg.RunsFilter(statuses=statuses, tags={"rlake/run_id": run_id}))
    for run in stale:
        instance.report_run_failed(run, message="the rlake train process running it was killed; the run was resumed")
    return [run.run_id[:8] for run in stale]


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
