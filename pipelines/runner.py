"""Run an rlake training run through Dagster in-process: set-up job, then one job run per iteration.

The runner only sequences jobs: everything a run leaves behind (tables, checkpoints, each checkpoint's
trainer_state.json, MLflow metrics) is written by the assets, so an iteration launched from the Dagster
UI leaves the same files as one run by `rlake train`. Each job run is launched like a UI launch: on the
run's partition (run, or run x iteration), with the resolved config as the run_config resource's launch
config (so the Dagster run records it), and the stages of that config.

The Dagster instance is DAGSTER_HOME's (else <output_dir>/dagster_home on sqlite): on a cluster, a
dagster.yaml with `storage: postgres: postgres_url: {env: VAR}` lets `rlake ui` on any host see the runs
`rlake train` records (docs/cluster.md). Each run records its driver (host, pid, process start time) as
tags, so a later `rlake train` of the same run marks failed only the runs whose driver is known dead,
never one a process elsewhere is still running (`_fail_stale_runs`).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path

import dagster as dg
import psutil

from assets.common import add_partitions, partition_key
from configs.errors import load_run_config
from configs.schema import RunConfig
from pipelines.dagster_storage import (  # noqa: F401 - API
    NUX_OFF,
    TELEMETRY_OFF,
    check_instance_yaml,
    dagster_home,
    pool_postgres_connections,
    remember_partition_keys,
    remember_schema,
)
from pipelines.definitions import build_definitions
from pipelines.heap import frozen_heap
from pipelines.jobs import ITERATION_JOB, SETUP_JOB, iteration_asset_keys
from pipelines.logs import failure_message
from pipelines.one_step_off import run_one_step_off
from pipelines.progress import RunProgress, asset_metadata, fmt_items, plain
from pipelines.resources import tables_root, tracker_for
from pipelines.sensors import DRIVER_TAG
from stages.io.checkpoints import ModelStore
from stages.run.lease import RunLease
from stages.run.preflight import preflight
from stages.run.resume import ResumePlan, plan_resume

log = logging.getLogger(__name__)
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
"""Dagster's console logger prints nothing: a failed step is one line from `rlake train` (pipelines/logs.py
report_failure), its traceback in the log file, its events in the Dagster UI."""
DRIVER_HOST_TAG = "rlake/driver_host"
DRIVER_PID_TAG = "rlake/driver_pid"
DRIVER_STARTED_TAG = "rlake/driver_started"
"""The process that executes a run in-process (`rlake train`): its host, pid and start time (epoch seconds; a
reused pid has another start time)."""


def driver_tags() -> dict[str, str]:
    """Tags naming this process as the driver of the runs it executes in-process (see _fail_stale_runs)."""
    me = psutil.Process()
    return {
        DRIVER_HOST_TAG: socket.gethostname(),
        DRIVER_PID_TAG: str(me.pid),
        DRIVER_STARTED_TAG: f"{me.create_time():.2f}",
    }


def run_tags(cfg: RunConfig) -> dict[str, str]:
    """The tags of every Dagster run `rlake train` executes for `cfg`: the rlake run, its config, this driver."""
    return {"rlake/run_id": cfg.run_id, DRIVER_TAG: "cli", "rlake/config_hash": cfg.config_hash(), **driver_tags()}


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
    The MLflow run is created right after preflight and marked FINISHED by the last iteration, FAILED when
    set-up (Dagster, warm start, Ray) or an iteration raises, with the error as tag rlake.error, and KILLED on
    Ctrl-C, so no run stays RUNNING in the MLflow UI. On a Ray cluster the run's workers go when this
    call ends, however it ends."""
    progress = progress or plain(log)
    cfg, plan = _prepare(config, overrides, run_id, steps, progress)
    lease = RunLease.for_config(cfg).acquire()  # one driver per run: a second one exits 2 here (stages/run/lease.py)
    tracker = tracker_for(cfg)
    tracker.run_for(cfg.run_id, cfg)  # the MLflow run exists (RUNNING) from here: a set-up failure ends it FAILED
    t0 = time.perf_counter()
    try:
        dagster_home(cfg.trainer.output_dir)
        progress.phase("dagster", "instance and definitions")
        defs = build_definitions(cfg)
        instance = _instance()
        _start(cfg, plan, instance, progress)
        setup, history = _run_jobs(defs, instance, cfg, plan, steps, progress)
    except BaseException as exc:
        status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        _end_mlflow_run(tracker, cfg.run_id, status, progress, error=exc)
        raise
    finally:
        _release_cluster_workers(cfg)
        lease.release()
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


def _instance() -> dg.DagsterInstance:
    """The DAGSTER_HOME's instance; on a team's Postgres it keeps its connections open for the run, and partition
    keys it found (and its schema) are not looked up again (dagster_storage.remember_partition_keys and
    remember_schema)."""
    instance = dg.DagsterInstance.get()
    if pool_postgres_connections(instance):
        remember_schema(instance)
    remember_partition_keys(instance)
    return instance


def _prepare(config, overrides, run_id, steps, progress: RunProgress):
    """The resolved config with its run id and the resume plan: a bad config or bad data/model input fails
    here, before warm start, Ray or MLflow."""
    cfg = _resolve(config, overrides, progress)
    progress.phase("preflight", "data and model inputs")
    preflight(cfg)
    plan = plan_resume(cfg, run_id or cfg.trainer.run_id, steps)
    cfg = cfg.with_run_id(plan.run_id or f"{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    return cfg, plan


def _release_cluster_workers(cfg: RunConfig) -> None:
    """On a cluster a run's workers are detached and outlive this process (the next process of the run finds
    them); when this process ends the run's call, its actors and placement groups go (`rlake gc` does the same
    after a crash). A local cluster takes its workers along when the driver exits."""
    import ray  # noqa: PLC0415 - only on the way out

    if cfg.ray.is_cluster and ray.is_initialized():
        from stages.workers.group import gc_run  # noqa: PLC0415

        gc_run(cfg.run_id)


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
    partial = ModelStore.for_config(cfg).remove_partial()
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
    tags = run_tags(cfg)
    run_config = launch_config(cfg)
    setup: dict = {}
    add_partitions(instance, cfg.run_id)
    if plan.run_setup:
        t0 = time.perf_counter()
        job = defs.resolve_job_def(SETUP_JOB)
        res = _execute(job, instance, progress, tags=tags, run_config=run_config, partition=cfg.run_id)
        setup = asset_metadata(res, "initial_policy")
        progress.line(f"setup done in {time.perf_counter() - t0:.1f}s: " + fmt_items(setup, "val"))
    total = cfg.trainer.total_training_steps if steps is None else steps
    progress.start_iterations(plan.start_iteration, total)
    with frozen_heap():
        if cfg.trainer.async_mode == "one_step_off":
            retry = functools.partial(with_iteration_retries, cfg, plan.start_iteration, total, progress)
            kw = {"tags": tags, "run_config": run_config, "execute": _execute, "retry": retry}
            return setup, run_one_step_off(defs, instance, cfg, plan.start_iteration, total, progress, **kw)
        kw = {"tags": tags, "run_config": run_config}
        return setup, _run_iterations(defs, instance, cfg, plan.start_iteration, total, progress, **kw)


def _run_iterations(defs, instance, cfg: RunConfig, start: int, total: int, progress: RunProgress, **kw) -> list[dict]:
    """Iterations start..total-1, one iteration job each, with iteration retries (with_iteration_retries);
    returns iteration_metrics' metadata per iteration."""

    def iterations(first: int) -> Iterator[tuple[int, dict]]:
        for it in range(first, total):
            t1 = time.perf_counter()
            meta = _run_iteration(defs, instance, cfg, it, progress, **kw)
            progress.iteration_done(it, time.perf_counter() - t1, fmt_items(meta, ""))
            yield it, meta

    return with_iteration_retries(cfg, start, total, progress, iterations)


def with_iteration_retries(
    cfg: RunConfig,
    start: int,
    total: int,
    progress: RunProgress,
    iterations: Callable[[int], Iterator[tuple[int, dict]]],
) -> list[dict]:
    """Run iterations(first), which yields (iteration, iteration_metrics' metadata) as each iteration finishes,
    from `start` until `total`; returns the metadata per iteration, in order. Both loops use it: one job per
    iteration (_run_iterations) and one_step_off's overlapped generation and training runs.

    An iteration that lost a worker (is_worker_loss: a node died, a placement group found no capacity) is re-run
    from the last committed checkpoint on rebuilt workers, up to trainer.max_iteration_retries times in a row
    (recover_iteration; one_step_off regenerates that iteration's rollouts first); then, or on any other error,
    the run stops (a lost worker: NodeLossError naming the resume command). Every table write replaces its
    partition, so a re-run iteration leaves each row once."""
    from stages.workers.faults import is_worker_loss  # noqa: PLC0415 - Ray, imported once a run iterates

    history: dict[int, dict] = {}
    it, failures = start, 0
    while it < total:
        try:
            for done, meta in iterations(it):
                history[done] = meta
                it, failures = done + 1, 0
        except Exception as exc:
            if not is_worker_loss(exc):
                raise
            failures += 1
            if failures > cfg.trainer.max_iteration_retries:
                raise NodeLossError(_give_up_message(cfg, it, failures, exc)) from exc
            it = recover_iteration(cfg, it, total, failures, exc, progress)
    return [history[i] for i in sorted(history)]


def _run_iteration(defs, instance, cfg: RunConfig, it: int, progress: RunProgress, **kw) -> dict:
    """One iteration job run of partition (run, it); iteration_metrics' metadata."""
    add_partitions(instance, cfg.run_id, it)
    res = _execute(
        defs.resolve_job_def(ITERATION_JOB),
        instance,
        progress,
        partition=partition_key(cfg.run_id, it),
        asset_selection=iteration_asset_keys(cfg),
        **kw,
    )
    return asset_metadata(res, "iteration_metrics")


class NodeLossError(RuntimeError):
    """An iteration lost workers more than trainer.max_iteration_retries times in a row; says how to resume."""


RETRY_PAUSE_S = 5.0
"""Seconds before re-running an iteration, times the failures so far: time for Ray to mark a lost node dead (its
health checks) and for new capacity to join, so a retry is not placed on the node that just died."""


def recover_iteration(
    cfg: RunConfig, it: int, total: int, failures: int, exc: BaseException, progress: RunProgress
) -> int:
    """After iteration `it` lost a worker: say so, remove the run's workers and placement groups (a group with a
    rank on a lost node is rebuilt whole, on the nodes alive now), drop partial checkpoint writes, and return
    the iteration to re-run: the resume plan's, i.e. the one after the last committed checkpoint. The rebuilt
    workers load that checkpoint from storage (no trainer alive holds newer weights)."""
    import ray  # noqa: PLC0415

    from stages.workers.group import gc_run  # noqa: PLC0415

    progress.line(
        f"iteration {it} lost a worker ({_first_line(exc)}); re-running it from the last committed checkpoint "
        f"on rebuilt workers, retry {failures} of trainer.max_iteration_retries={cfg.trainer.max_iteration_retries}"
    )
    if ray.is_initialized():
        gone = gc_run(cfg.run_id)
        log.info("removed the run's workers %s and placement groups %s", gone["actors"], gone["placement_groups"])
    time.sleep(RETRY_PAUSE_S * failures)
    partial = ModelStore.for_config(cfg).remove_partial()
    if partial:
        progress.line(f"removed partial checkpoint writes: {partial}")
    auto = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"resume_mode": "auto"})})
    plan = plan_resume(auto, cfg.run_id, total)  # this run's own progress, whatever its resume_mode
    progress.line(plan.reason)
    return min(plan.start_iteration, it)


def _first_line(exc: BaseException) -> str:
    """The error on one line, at most 400 characters (Ray's actor errors run over several lines: which actor, and
    why it died, e.g. its node's death)."""
    text = " ".join(failure_message(exc).split())
    return text if len(text) <= 400 else text[:397] + "..."


def _give_up_message(cfg: RunConfig, it: int, failures: int, exc: BaseException) -> str:
    return (
        f"iteration {it} lost a worker {failures} times in a row (trainer.max_iteration_retries="
        f"{cfg.trainer.max_iteration_retries}); last: {_first_line(exc)}. Its tables and checkpoints are intact. "
        f"Once the Ray cluster has the capacity again (ray.resources_per_worker), resume with: rlake train "
        f"--config <your config> --run-id {cfg.run_id}"
    )


def _end_mlflow_run(
    tracker, run_id: str, status: str, progress: RunProgress, *, error: BaseException | None = None
) -> None:
    """Mark the MLflow run ended (FAILED / KILLED: `error` as its rlake.error tag) without hiding the error that
    ended it."""
    try:
        tracker.end_run(run_id, status, error=None if error is None else f"{type(error).__name__}: {error}")
    except Exception as exc:  # the store itself may be what failed
        progress.line(f"could not mark MLflow run {run_id} {status}: {exc}")


def _execute(
    job, instance, progress: RunProgress | None, *, tags: dict, run_config: dict, partition: str, asset_selection=None
):
    """One in-process Dagster run of one partition, its steps shown by `progress` as they start (None: not shown,
    a run beside the one shown: pipelines/one_step_off.py)."""
    dagster_run_id = str(uuid.uuid4())
    with progress.follow(instance, dagster_run_id) if progress is not None else nullcontext():
        return job.execute_in_process(
            instance=instance,
            tags=tags,
            run_config=run_config,
            partition_key=partition,
            asset_selection=asset_selection,
            run_id=dagster_run_id,
        )


def _fail_stale_runs(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    """Mark failed the Dagster runs of rlake run `run_id` still STARTING/STARTED whose worker is known gone;
    returns their short ids. A run that may still be running (on this host or another) is left alone.

    The instance may be shared (Postgres), so a STARTED run can be alive elsewhere: see run_worker_gone."""
    statuses = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING]
    failed = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=statuses, tags={"rlake/run_id": run_id})):
        why = run_worker_gone(instance, run)
        if why is not None:
            instance.report_run_failed(run, message=f"{why}; the rlake run was resumed by pid {os.getpid()}")
            failed.append(run.run_id[:8])
    return failed


def run_worker_gone(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str | None:
    """Why the process executing `run` is known to be gone, or None while it may be alive.

    - A run `rlake train` executes in-process records its driver (driver_tags): gone when that host is this
      one and the pid is not running, or runs another process (a start time other than recorded). A driver
      on another host is never judged from here (its own next start, or the operator, ends it).
    - A run a launcher started (the UI, the chaining sensor): Dagster's run monitoring, i.e. the launcher's
      worker health check (K8s, ECS, Docker launchers); the default launcher has none, so such a run is left
      to the daemon's run monitoring (`run_monitoring:` in dagster.yaml: start and max-runtime timeouts).
    - A run of an older rlake that recorded no driver: unknown, left alone."""
    tags = run.tags
    if DRIVER_PID_TAG in tags:
        host, pid = tags.get(DRIVER_HOST_TAG), int(tags[DRIVER_PID_TAG])
        if host != socket.gethostname():
            return None
        try:
            proc = psutil.Process(pid)
            started, zombie = proc.create_time(), proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return f"its driver, pid {pid} on {host}, has exited"
        except psutil.AccessDenied:
            return None  # running, as another user
        if zombie:
            return f"its driver, pid {pid} on {host}, has exited (not yet reaped)"
        if abs(started - float(tags.get(DRIVER_STARTED_TAG, started))) > 1.0:
            return f"its driver, pid {pid} on {host}, has exited (the pid now runs another process)"
        return None
    if tags.get(DRIVER_TAG) == "cli":  # in-process, from an rlake without driver tags
        return None
    launcher = instance.run_launcher
    if not launcher.supports_check_run_worker_health:
        return None
    health = launcher.check_run_worker_health(run)
    if health.status.name in ("FAILED", "NOT_FOUND"):  # dagster's WorkerStatus (not exported publicly)
        return f"Dagster's run monitoring found its worker {health.status.name}: {health.msg or 'no detail'}"
    return None
