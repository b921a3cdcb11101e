"""Chaining: when set-up or iteration i of a run succeeds, launch iteration i+1 of the same run with the same
launched config (the finished run's run_config, carried as is) and that config's stages.

Runs driven by `rlake train` (tag rlake/driver=cli) sequence their own iterations; the sensor leaves them
alone, so a daemon that runs beside `rlake train` never launches an iteration twice. A run that
re-materialized part of a partition (a re-score) chains nothing either."""

from __future__ import annotations

from collections.abc import Mapping

import dagster as dg

from assets.common import add_partitions, partition_key
from assets.resources import partition_run_id, resolve_run_config
from pipelines.jobs import ITERATION_JOB, SETUP_JOB, iteration_asset_keys, iteration_job

DRIVER_TAG = "rlake/driver"
"""Who launched a Dagster run of rlake: cli (`rlake train`, `rlake rescore`), sensor, or absent (the UI)."""


def next_iteration(job_name: str, iteration: str | None, total_steps: int) -> int | None:
    """The iteration to launch after a successful run of `job_name` (iteration: its partition's iteration,
    None for set-up), or None when done."""
    if job_name == SETUP_JOB:
        return 0 if total_steps > 0 else None
    if job_name == ITERATION_JOB and iteration is not None:
        nxt = int(iteration) + 1
        return nxt if nxt < total_steps else None
    return None


def launched_config(run_config: Mapping, defaults: Mapping[str, object]):
    """The RunConfig a Dagster run was launched with: its resources.run_config.config over the code
    location's defaults (what the launchpad pre-fills)."""
    given = ((run_config or {}).get("resources", {}).get("run_config", {}) or {}).get("config", {}) or {}
    merged = {"config_json": "", "config_path": "", "overrides": [], **defaults, **given}
    return resolve_run_config(merged["config_json"], merged["config_path"], list(merged["overrides"]))


def make_next_iteration_sensor(
    defaults: Mapping[str, object], request_job=iteration_job
) -> dg.RunStatusSensorDefinition:
    """defaults: the code location's launch-time defaults of the run_config resource (pipelines/resources.py)."""

    @dg.run_status_sensor(
        run_status=dg.DagsterRunStatus.SUCCESS,
        name="next_iteration_sensor",
        monitor_all_code_locations=False,
        request_job=request_job,
        default_status=dg.DefaultSensorStatus.STOPPED,
        minimum_interval_seconds=5,
    )
    def next_iteration_sensor(context: dg.RunStatusSensorContext):
        run = context.dagster_run
        if run.tags.get(DRIVER_TAG) == "cli":
            return dg.SkipReason(f"run {run.run_id[:8]} was launched by the rlake CLI, which chains its own iterations")
        last = {SETUP_JOB: "initial_policy", ITERATION_JOB: "iteration_metrics"}.get(run.job_name)
        if run.asset_selection is not None and dg.AssetKey(last) not in run.asset_selection:
            return dg.SkipReason(
                f"run {run.run_id[:8]} re-materialized only {sorted(k.to_user_string() for k in run.asset_selection)}: "
                "a partial run (e.g. a re-score) does not start the next iteration"
            )
        run_id = partition_run_id(dict(run.tags))
        if run_id is None:
            return dg.SkipReason(f"{run.job_name} run {run.run_id[:8]} has no run partition")
        try:
            cfg = launched_config(run.run_config, defaults).with_run_id(run_id)
        except ValueError as exc:  # the run itself would have failed; say why nothing follows
            return dg.SkipReason(f"the config of run {run.run_id[:8]} no longer resolves: {exc}")
        nxt = next_iteration(
            run.job_name, run.tags.get("dagster/partition/iteration"), cfg.trainer.total_training_steps
        )
        if nxt is None:
            return dg.SkipReason(f"{run.job_name} {run.tags.get('dagster/partition')} has no successor")
        add_partitions(context.instance, run_id, nxt)
        return dg.RunRequest(
            run_key=f"iteration-{nxt}-of-{run_id}-after-{run.run_id}",
            partition_key=partition_key(run_id, nxt),
            run_config=run.run_config,
            asset_selection=iteration_asset_keys(cfg),
            tags={"rlake/run_id": run_id, DRIVER_TAG: "sensor", "rlake/config_hash": cfg.config_hash()},
        )

    return next_iteration_sensor
