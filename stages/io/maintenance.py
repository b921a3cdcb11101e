"""Table maintenance of a run's lake: compaction, Delta checkpoints and VACUUM that keeps what lineage reads.

Every stage write adds a few small parquet files and one JSON commit per table, so a long run's tables hold
thousands of small files and `rlake sql` (and every open of a table) slows down. Three steps, each optional:

- compact: `optimize.compact()` rewrites each partition's small files into one file per partition (about
  `target_size` bytes). Same rows, one new table version (operation OPTIMIZE, no rlake lineage); the
  versions before it still read their old files until a VACUUM deletes them.
- checkpoint: `create_checkpoint()` writes the table's state as one parquet file, so opening the table reads
  it plus the commits after it instead of replaying every JSON commit. Older checkpoints are then deleted but one
  per span of KEEP_CHECKPOINT_EVERY versions (`prune_checkpoints`): the tables write one every
  `delta.checkpointInterval` (store.TABLE_CONFIGURATION) commits and never expire the log, so without it they
  pile up, each the size of the whole table's file list.
- vacuum: deletes files no version newer than `vacuum_retention_hours` reads, except the files of the
  versions rlake's lineage records (`keep_lineage`, default): each rlake commit's own version and every
  upstream version a commit says it read, which are the versions replay, rescore and resume time-travel to.
  Without `keep_lineage`, a recorded version whose files were vacuumed can no longer be read:
  `check_version_files` turns that into a `VacuumedVersionError` saying what, why and how to fix.

The commit log itself (the lineage `rlake lineage` and `commit_lineage` read) is never cleaned here.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from stages.io import objects, store, uris
from stages.io.store import Options

DEFAULT_VACUUM_RETENTION_HOURS = 168
"""Delta's default `delta.deletedFileRetentionDuration` (7 days): files removed from a table less than this
long ago are never vacuumed."""


KEEP_CHECKPOINT_EVERY = 100
"""prune_checkpoints keeps the newest checkpoint of each span of this many versions (0-99, 100-199, ...; delta-rs's
default interval): a time-travel open of an old version replays fewer than this many JSON commits plus
`delta.checkpointInterval` after the checkpoint it starts from."""


class VacuumedVersionError(LookupError):
    """A table version rlake recorded can no longer be read: VACUUM deleted data files it reads."""


@dataclass
class TableReport:
    """What maintenance did to one table (dry run: what it would do)."""

    table: str
    files_before: int
    files_after: int
    version_before: int
    version_after: int
    compacted_files: int = 0
    """Files rewritten by compaction (numFilesRemoved); 0 when nothing was compacted."""
    checkpoint_version: int | None = None
    pruned_checkpoints: int = 0
    """Older checkpoint files deleted after it (prune_checkpoints)."""
    vacuumed_files: int = 0
    """Files deleted by VACUUM (dry run: that it would delete)."""
    kept_versions: int = 0
    """Versions whose files VACUUM kept because the lineage records them."""
    seconds: float = 0.0
    steps_s: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One line for the CLI: files and versions before -> after, what each step did, seconds."""
        checkpoint = "-" if self.checkpoint_version is None else f"v{self.checkpoint_version}"
        return (
            f"{self.table}: files {self.files_before} -> {self.files_after}, version {self.version_before} -> "
            f"{self.version_after}, compacted {self.compacted_files}, checkpoint {checkpoint} (older ones pruned: "
            f"{self.pruned_checkpoints}), vacuumed "
            f"{self.vacuumed_files} (kept {self.kept_versions} lineage versions), {self.seconds:.2f} s"
        )


def list_tables(root: str, storage_options: Options = None) -> list[str]:
    """Names of the Delta tables directly under the tables root (sorted)."""
    opts = uris.options_of(root, storage_options)
    try:
        names = uris.list_dirs(root, opts)
    except FileNotFoundError:
        return []
    return [n for n in names if store.table_exists(uris.join(root, n), storage_options=opts)]


def lineage_versions(root: str, tables: list[str], storage_options: Options = None) -> dict[str, set[int]]:
    """Per table, the versions rlake's lineage records: each rlake commit's own version (what Dagster records as
    `delta_version`) and every version a commit of any table under `root` says it read (`rlake.upstream`)."""
    opts = uris.options_of(root, storage_options)
    keep: dict[str, set[int]] = {t: set() for t in tables}
    for table in tables:
        for commit in store.commit_lineage(uris.join(root, table), storage_options=opts):
            keep[table].add(int(commit["version"]))
            for upstream, version in (commit.get("upstream") or {}).items():
                if upstream in keep and version is not None:
                    keep[upstream].add(int(version))
    return keep


def file_count(dt: DeltaTable) -> int:
    """Data files the table's loaded version reads."""
    return dt.get_add_actions().num_rows


def _compact(dt: DeltaTable, partition_filters: list[tuple[str, str, Any]] | None, target_size: int | None) -> int:
    metrics = dt.optimize.compact(partition_filters=partition_filters, target_size=target_size)
    return int(metrics.get("numFilesRemoved", 0))


def _vacuum(dt: DeltaTable, hours: int, keep: set[int], *, dry_run: bool, enforce: bool) -> int:
    """Files VACUUM deletes (dry run: would delete), keeping the files of the versions in `keep`. A full
    vacuum: files no commit names (a failed write's) count too."""
    versions = sorted(v for v in keep if v <= dt.version())
    try:
        gone = dt.vacuum(
            retention_hours=hours,
            dry_run=dry_run,
            enforce_retention_duration=enforce,
            full=True,
            keep_versions=versions or None,
        )
    except DeltaError as exc:
        if "retention period" not in str(exc):
            raise
        raise ValueError(_short_retention(dt.table_uri, hours) + f" (delta-rs: {str(exc).splitlines()[0]})") from exc
    return len(gone)


def _short_retention(where: str, hours: int) -> str:
    return (
        f"VACUUM of '{where}' with a {hours} h retention: that is under the tables' delta.deletedFileRetentionDuration "
        f"({DEFAULT_VACUUM_RETENTION_HOURS} h unless a table sets it), and a shorter retention can delete files a "
        "reader or writer still uses; pass enforce_retention_duration=False (rlake maintain --allow-short-retention) "
        "if no run reads or writes the tables now"
    )


@dataclass(frozen=True)
class MaintenancePlan:
    """Which steps to run and how (the keyword arguments of maintain_tables)."""

    compact: bool = True
    checkpoint: bool = True
    vacuum_retention_hours: int | None = DEFAULT_VACUUM_RETENTION_HOURS
    """None: no VACUUM."""
    keep_lineage: bool = True
    enforce_retention_duration: bool = True
    partition_filters: list[tuple[str, str, Any]] | None = None
    target_size: int | None = None
    dry_run: bool = False


ENFORCED_PROPERTIES = ("delta.enableExpiredLogCleanup",)
"""Table properties `rlake maintain` sets to rlake's value whatever the table has: the commit log is the lineage
and the replay's time travel, so it is never expired. The others of store.TABLE_CONFIGURATION (checkpoint
interval, statistics columns) are tuning: set where a table lacks them, a value a user chose is kept."""


def _keep_log(dt: DeltaTable, dry_run: bool) -> DeltaTable:
    """A table created before rlake set store.TABLE_CONFIGURATION gets it (one metadata commit): its commit log,
    the lineage, is then never expired by delta-rs's automatic checkpoints. A tuning property the table already
    has (a user's own delta.checkpointInterval) is left as it is (ENFORCED_PROPERTIES)."""
    config = dt.metadata().configuration
    missing = {
        k: v
        for k, v in store.TABLE_CONFIGURATION.items()
        if config.get(k) != v and (k in ENFORCED_PROPERTIES or k not in config)
    }
    if missing and not dry_run:
        dt.alter.set_table_properties(missing)
    return dt


def _checkpoint_version(name: str) -> int | None:
    """The version of a `_delta_log` entry that is a checkpoint file (classic, multi-part or V2), else None."""
    head, _, rest = name.partition(".")
    return int(head) if head.isdigit() and rest.startswith("checkpoint.") and name.endswith(".parquet") else None


def prune_checkpoints(uri: str, *, dry_run: bool = False, storage_options: Options = None) -> int:
    """Delete the checkpoint files of table `uri` but the newest checkpoint of each span of KEEP_CHECKPOINT_EVERY
    versions; returns how many (dry run: would delete). A checkpoint only speeds up
    opening a version at or after it: every JSON commit stays, so every version still opens, by replaying the
    commits after the newest checkpoint kept before it. Run it when no reader opens an old version of the table
    (the maintenance rule: no run writes the tables)."""
    store_ = objects.open_store(uris.target(uri), uris.options_of(uri, storage_options))
    found = {}
    for key in objects.list_keys(store_, "_delta_log"):
        version = _checkpoint_version(key.rsplit("/", 1)[-1])
        if version is not None:
            found.setdefault(version, []).append(key)
    kept = {}
    for version in found:  # the newest of each span
        span = version // KEEP_CHECKPOINT_EVERY
        kept[span] = max(version, kept.get(span, version))
    gone = [k for v, keys in found.items() if v not in kept.values() for k in keys]
    if gone and not dry_run:
        objects.delete(store_, gone)
    return len(gone)


def maintain_table(uri: str, plan: MaintenancePlan, keep: set[int], storage_options: Options = None) -> TableReport:
    """Compact, checkpoint and vacuum one table as `plan` says, keeping the files of versions `keep`."""
    t0, steps = time.perf_counter(), {}
    dt = _keep_log(store.open_table(uri, storage_options=storage_options), plan.dry_run)
    report = TableReport(uris.name(uri), file_count(dt), file_count(dt), dt.version(), dt.version())
    if plan.compact and not plan.dry_run:
        report.compacted_files = _compact(dt, plan.partition_filters, plan.target_size)
        steps["compact"] = time.perf_counter() - t0
        dt = store.open_table(uri, storage_options=storage_options)
    if plan.vacuum_retention_hours is not None:
        t = time.perf_counter()
        report.kept_versions = len(keep) if plan.keep_lineage else 0
        report.vacuumed_files = _vacuum(
            dt,
            plan.vacuum_retention_hours,
            keep if plan.keep_lineage else set(),
            dry_run=plan.dry_run,
            enforce=plan.enforce_retention_duration,
        )
        steps["vacuum"] = time.perf_counter() - t
        dt = store.open_table(uri, storage_options=storage_options)
    if plan.checkpoint and not plan.dry_run:  # last: the checkpoint holds the newest version
        t = time.perf_counter()
        dt.create_checkpoint()
        report.checkpoint_version = dt.version()
        report.pruned_checkpoints = prune_checkpoints(uri, storage_options=storage_options)
        steps["checkpoint"] = time.perf_counter() - t
    report.files_after, report.version_after = file_count(dt), dt.version()
    report.seconds, report.steps_s = time.perf_counter() - t0, steps
    return report


def maintain_tables(
    root: str, storage_options: Options = None, *, tables: list[str] | None = None, **plan: Any
) -> list[TableReport]:
    """Maintain every Delta table under the tables root (or `tables`): `plan` holds MaintenancePlan's fields
    (compact=True, checkpoint=True, vacuum_retention_hours=168, keep_lineage=True, ...). Run it when no run
    writes the tables: a compaction and a concurrent write of the same partition conflict, and one of them fails."""
    options = MaintenancePlan(**plan)
    hours = options.vacuum_retention_hours
    if hours is not None and hours < DEFAULT_VACUUM_RETENTION_HOURS and options.enforce_retention_duration:
        raise ValueError(_short_retention(root, hours))  # before any table changes
    opts = uris.options_of(root, storage_options)
    found = list_tables(root, opts)
    if not found:
        raise FileNotFoundError(
            f"no Delta tables under '{root}': run `rlake train` first, or point at the run's tables with --tables / "
            "--config (storage.root, trainer.output_dir)"
        )
    unknown = sorted(set(tables or []) - set(found))
    if unknown:
        raise ValueError(f"no Delta tables {unknown} under '{root}'; tables: {found}")
    names = tables or found
    needs_lineage = options.vacuum_retention_hours is not None and options.keep_lineage
    keep = lineage_versions(root, found, opts) if needs_lineage else {}
    return [maintain_table(uris.join(root, n), options, keep.get(n, set()), opts) for n in names]


def missing_files(dt: DeltaTable, run_id: str | None = None, iteration: int | None = None) -> list[str]:
    """Data files of the loaded version of `dt` (optionally of one (run_id, iteration) partition) that are gone
    from storage: one metadata request per file, no data read."""
    partitions = [] if run_id is None else [("run_id", "=", run_id)]
    partitions += [] if iteration is None else [("iteration", "=", str(iteration))]
    dataset = dt.to_pyarrow_dataset(partitions=partitions or None)
    infos = dataset.filesystem.get_file_info(list(dataset.files))
    return [info.path for info in infos if info.type.name == "NotFound"]


def check_version_files(
    uri: str,
    version: int,
    *,
    run_id: str | None = None,
    iteration: int | None = None,
    storage_options: Options = None,
) -> None:
    """Raise VacuumedVersionError when table `uri` at `version` (of one partition, if given) reads files that are
    gone: what, why and how to fix. Cheap (metadata requests only): call it when reading a recorded version
    fails with FileNotFoundError, or before a long job (replay) reads one."""
    dt = store.open_table(uri, version=version, storage_options=storage_options)
    gone = missing_files(dt, run_id, iteration)
    if not gone:
        return
    where = (
        "" if run_id is None else f" (run '{run_id}'" + ("" if iteration is None else f" iteration {iteration}") + ")"
    )
    raise VacuumedVersionError(
        f"table '{uris.name(uri)}' version {version}{where} can no longer be read: {len(gone)} of its data files "
        f"are gone, e.g. '{gone[0]}'. Why: a VACUUM (`rlake maintain --no-keep-lineage` or a retention shorter than "
        "this version's age) deleted files that only older versions read, so time travel to it, and the replay, "
        "re-score or resume that reads the version rlake recorded, cannot work. Fix: re-materialize that "
        "partition (rerun the iteration) or restore the files from a backup; next time run `rlake maintain` "
        "with its default, which keeps every version the lineage records."
    )
