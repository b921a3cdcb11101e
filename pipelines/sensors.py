"""Chaining: when set-up or iteration i succeeds, add partition i+1 and launch it."""

from __future__ import annotations

import dagster as dg

from pipelines.jobs import ITERATION_JOB, SETUP_JOB, iteration_job


def next_iteration(job_name: str, partition_key: str | None, total_steps: int) -> int | None:
    """The iteration to launch after a successful run of `job_name`, or None when done."""
    if job_name == SETUP_JOB:
        return 0
    if job_name == ITERATION_JOB and partition_key is not None:
        nxt = int(partition_key) + 1
        return nxt if nxt < total_steps else None
    return None


def make_next_iteration_sensor(total_steps: int, request_job=iteration_job) -> dg.RunStatusSensorDefinition:
    """request_job: the Definitions' iteration job (pipelines.jobs.make_iteration_job(cfg))."""

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
        nxt = next_iteration(run.job_name, run.tags.get("dagster/partition"), total_steps)
        if nxt is None:
            return dg.SkipReason(f"{run.job_name} {run.tags.get('dagster/partition')} has no successor")
        context.instance.add_dynamic_partitions("iteration", [str(nxt)])
        return dg.RunRequest(run_key=f"iteration-{nxt}-after-{run.run_id}", partition_key=str(nxt))

    return next_iteration_sensor
