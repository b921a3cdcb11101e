"""The `lake_maintenance` job and its schedule: compaction, checkpoints and VACUUM of a run's Delta tables
(stages/io/maintenance.py; docs/lake.md "Maintenance").

The job's one op maintains every table under the launched config's tables root (the `rollout_store` resource).
The schedule (weekly, Sunday 03:00) is registered STOPPED: a compaction and a training write of the same
partition conflict, so turn it on only where no run writes at that hour.
"""

# no `from __future__ import annotations`: Dagster reads the op's config class from its real annotation
import dagster as dg

from assets.resources import RolloutStoreResource
from stages.io.maintenance import DEFAULT_VACUUM_RETENTION_HOURS, maintain_tables

LAKE_MAINTENANCE_JOB = "lake_maintenance"


class MaintenanceConfig(dg.Config):
    """Launch config of `maintain_lake` (the keyword arguments of stages/io/maintenance.py maintain_tables)."""

    compact: bool = True
    """Rewrite each partition's small files into one file (same rows, one new table version)."""
    checkpoint: bool = True
    """Write a Delta checkpoint of each table's newest version (faster opens)."""
    vacuum: bool = True
    """Delete files no version newer than vacuum_retention_hours reads (except lineage versions)."""
    vacuum_retention_hours: int = DEFAULT_VACUUM_RETENTION_HOURS
    """Files removed from a table less than this many hours ago are kept (Delta's default: 168 = 7 days)."""
    keep_lineage: bool = True
    """Keep the files of every version rlake's lineage records (replay, rescore, resume read them)."""
    enforce_retention_duration: bool = True
    """False allows a retention shorter than the table's delta.deletedFileRetentionDuration (7 days)."""
    run_id: str = ""
    """Only compact the partitions of this run ('' = every run)."""
    dry_run: bool = False
    """Only report files and what VACUUM would delete: no compaction, checkpoint or deletion."""


@dg.op(description="Compact, checkpoint and vacuum every Delta table of the launched config's tables root.")
def maintain_lake(context: dg.OpExecutionContext, config: MaintenanceConfig, rollout_store: RolloutStoreResource):
    reports = maintain_tables(
        rollout_store.location,
        compact=config.compact,
        checkpoint=config.checkpoint,
        vacuum_retention_hours=config.vacuum_retention_hours if config.vacuum else None,
        keep_lineage=config.keep_lineage,
        enforce_retention_duration=config.enforce_retention_duration,
        partition_filters=[("run_id", "=", config.run_id)] if config.run_id else None,
        dry_run=config.dry_run,
    )
    for report in reports:
        context.log.info(report.line())
    metadata = {r.table: dg.MetadataValue.json(r.as_dict()) for r in reports}
    files = (sum(r.files_before for r in reports), sum(r.files_after for r in reports))
    context.add_output_metadata({"files_before": files[0], "files_after": files[1], **metadata})
    return [r.as_dict() for r in reports]


@dg.job(name=LAKE_MAINTENANCE_JOB, description="Table maintenance of the run's lake (docs/lake.md Maintenance).")
def lake_maintenance() -> None:
    maintain_lake()


lake_maintenance_schedule = dg.ScheduleDefinition(
    name="lake_maintenance_weekly",
    job=lake_maintenance,
    cron_schedule="0 3 * * 0",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Weekly table maintenance; stopped by default (start it where no run writes at that hour).",
)
