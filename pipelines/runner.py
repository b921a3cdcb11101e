"""Run an rlake training run through Dagster in-process: set-up job, then one job run per iteration."""
from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pipelines.progress import RunProgress, plain

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


def run_training(config_path: str, overrides: list[str], *, run_id: str | None = None, steps: int | None = None,
                 log: Callable[[str], None] = print, progress: RunProgress | None = None) -> dict:
    """Returns {"run_id", "setup": metadata of initial_policy, "iterations": [metadata of iteration_metrics]}.

    `progress` shows what is running (pipelines/progress.py); without one, plain lines go to `log`.
    The MLflow run is marked FINISHED by the last iteration, FAILED when an iteration raises and KILLED
    on Ctrl-C, so no run stays RUNNING in the MLflow UI."""
    from pydantic import ValidationError

    from configs.schema import load_config
    from stages.run.preflight import explain_config_error, preflight
    from stages.run.resume import plan_resume

    progress = progress or plain(log)
    overrides = list(overrides)
    progress.phase("config", config_path)
    try:
        cfg = load_config(config_path, overrides)  # a bad config fails here, before any work
    except ValidationError as exc:
        raise explain_config_error(exc) from None

    progress.phase("preflight", "data and model inputs")
    preflight(cfg)  # bad data / model input fails here, before warm-start or Ray
    plan = plan_resume(cfg, run_id or cfg.trainer.run_id, steps)
    run_id = plan.run_id or f"{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides.append(f"trainer.run_id={run_id}")
    cfg = load_config(config_path, overrides)
    dagster_home(cfg.trainer.output_dir)
    progress.phase("dagster", "instance and definitions")
    import dagster as dg

    from pipelines.definitions import build_definitions
    from pipelines.jobs import ITERATION_JOB, SETUP_JOB

    defs = build_definitions(config_path, overrides)
    instance = dg.DagsterInstance.get()
    out = Path(cfg.trainer.output_dir).resolve()
    progress.line(f"rlake run {run_id}  config {config_path}  hash {cfg.config_hash()}  output {out}")
    progress.line(plan.reason)
    partial = _model_store(out, run_id).remove_partial()
    if partial:
        progress.line(f"removed partial checkpoint writes of a killed run: {partial}")
    stale = _fail_stale_runs(instance, run_id)
    if stale:
        progress.line(f"marked {len(stale)} Dagster run(s) of a killed process as failed: {stale}")
    tracker = defs.resources["tracker"]
    t0 = time.perf_counter()
    tags = {"rlake/run_id": run_id}
    setup: dict = {}
    history = []
    try:
        if plan.run_setup:
            result = _execute(defs.resolve_job_def(SETUP_JOB), instance, progress, tags=tags)
            setup = _metadata(result, "initial_policy")
            _save_trainer_state(cfg, out, run_id, 0)
            progress.line(f"setup done in {time.perf_counter() - t0:.1f}s: " + _fmt_items(setup, "val"))
        total = cfg.trainer.total_training_steps if steps is None else steps
        progress.start_iterations(plan.start_iteration, total)
        for it in range(plan.start_iteration, total):
            t1 = time.perf_counter()
            instance.add_dynamic_partitions("iteration", [str(it)])
            res = _execute(defs.resolve_job_def(ITERATION_JOB), instance, progress, tags=tags, partition_key=str(it))
            history.append(_metadata(res, "iteration_metrics"))
            _save_trainer_state(cfg, out, run_id, it + 1)
            progress.iteration_done(it, time.perf_counter() - t1, _fmt_items(history[-1], ""))
    except KeyboardInterrupt:
        _end_mlflow_run(tracker, run_id, "KILLED", progress)
        raise
    except BaseException:
        _end_mlflow_run(tracker, run_id, "FAILED", progress)
        raise
    _end_mlflow_run(tracker, run_id, "FINISHED", progress)  # also a --steps stop short of the last iteration
    progress.line(f"done: {len(history)} iterations in {time.perf_counter() - t0:.1f}s. Tables: {out / 'tables'}; "
                  f"MLflow: {tracker.tracking_uri} (experiment {cfg.trainer.project_name}, run {run_id})")
    return {"run_id": run_id, "setup": setup, "iterations": history, "start_iteration": plan.start_iteration,
            "resume": plan.reason}


def _end_mlflow_run(tracker, run_id: str, status: str, progress: RunProgress) -> None:
    """Mark the MLflow run ended without hiding the error that ended it."""
    try:
        tracker.end_run(run_id, status)
    except Exception as exc:  # the store itself may be what failed
        progress.line(f"could not mark MLflow run {run_id} {status}: {exc}")


def _execute(job, instance, progress: RunProgress, *, tags: dict, partition_key: str | None = None):
    """One in-process Dagster run, its steps shown by `progress` as they start."""
    dagster_run_id = str(uuid.uuid4())
    with progress.follow(instance, dagster_run_id):
        return job.execute_in_process(instance=instance, tags=tags, run_config=QUIET, partition_key=partition_key,
                                      run_id=dagster_run_id)


def _fail_stale_runs(instance, run_id: str) -> list[str]:
    """Dagster runs of this rlake run still STARTED/STARTING: their process was killed (runs are in-process)."""
    import dagster as dg

    statuses = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING]
    stale = instance.get_runs(filters=dg.RunsFilter(statuses=statuses, tags={"rlake/run_id": run_id}))
    for run in stale:
        instance.report_run_failed(run, message="the rlake train process running it was killed; the run was resumed")
    return [run.run_id[:8] for run in stale]


def _model_store(out: Path, run_id: str):
    from stages.io.checkpoints import ModelStore

    return ModelStore(out / "checkpoints", run_id)


def _save_trainer_state(cfg, out: Path, run_id: str, version: int) -> None:
    """trainer_state.json next to policy_v<version> (when that version is kept after pruning)."""
    from stages.run.resume import trainer_state, write_trainer_state
    from stages.io.store import read_partition

    policy_dir = _model_store(out, run_id).policy_dir(version)
    if not (policy_dir / "config.json").is_file():
        return
    prompts = read_partition(str(out / "tables" / "prompts"), run_id, -1, columns=["split"])
    write_trainer_state(policy_dir, trainer_state(cfg, run_id, version, int((prompts["split"] == "train").sum())))


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
