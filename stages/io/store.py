"""Delta Lake table I/O with lineage: every commit carries run id, iteration, policy version,
config hash, code version and the versions of the upstream tables the stage read.

Tables are partitioned by (run_id, iteration); a write replaces exactly its own partition
(`predicate`), so a retried or re-materialized stage never duplicates rows and never touches
other iterations.

A table is named by a storage URI (stages/io/uris.py): a local path or `file://` URI, or `s3://bucket/...`.
Every function takes `storage_options` (delta-rs options: endpoint, region, allow_http; None for local),
defaulting to the options a StorageURI carries; credentials come from the process environment
(AWS_ACCESS_KEY_ID, ...), never from the options, so they never reach a commit's metadata.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError

from stages.io import commit_reads, uris
from stages.io.tables import COLUMN_DEFAULTS, COMMIT_SETS, EXTRA_COLUMNS, LEGACY_FIELDS, SCHEMAS
from stages.io.whole_reads import whole_small_files

LINEAGE_PREFIX = "rlake."


CHECKOUT = Path(__file__).resolve().parents[2]
"""Where rlake's source lives (stages/io/store.py -> the repository root in a git checkout)."""


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=CHECKOUT, capture_output=True, text=True, timeout=5, check=True
    ).stdout.strip()


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """Full commit sha of the checkout rlake's source lives in; None when it is not a git checkout."""
    try:
        out = _git("rev-parse", "--show-toplevel", "HEAD").split()
    except (OSError, subprocess.SubprocessError):
        return None
    # an installed copy (site-packages) inside some other repository is not rlake's checkout
    return out[1] if len(out) == 2 and Path(out[0]).resolve() == CHECKOUT else None


@lru_cache(maxsize=1)
def code_version() -> str:
    """Git commit of the rlake checkout (12 hex digits, '+dirty' when modified), else the package version."""
    sha = git_commit()
    if sha is not None:
        try:
            return sha[:12] + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return "rlake-" + version("rlake")
    except PackageNotFoundError:
        return "unknown"


Options = Mapping[str, str] | None
"""delta-rs storage_options of a table URI (None: local, or taken from a StorageURI / the environment)."""


def _open(uri: str, storage_options: Options) -> tuple[str, dict[str, str] | None]:
    """(what delta-rs opens, its storage_options): explicit options, else those `uri` carries."""
    return uris.target(uri), uris.options_of(uri, storage_options)


_TABLES: dict[tuple[str, str], tuple[DeltaTable, tuple | None, int]] = {}
"""This process's open copy of each table's newest version (open_table), with its creation stamp (_created) and
the version it was opened at."""
_TABLES_LOCK = threading.Lock()

REOPEN_AFTER = 16
"""Commits an open table absorbs incrementally before open_table opens it anew. delta-rs keeps every commit applied
since the open in the table's log segment and replays them on each scan and write: measured on a 16-row-per-
partition table, a write through a table opened 420 commits earlier took 136 ms, through a fresh one 13 ms."""


def _created(path: str) -> tuple | None:
    """What tells a local table from one deleted and created again at the same path: its first commit file's
    inode and mtime (None: a remote table, or a log without its first commit)."""
    if not uris.is_local(path):
        return None
    try:
        st = (uris.local_path(path) / "_delta_log" / f"{0:020d}.json").stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


_PINNED = threading.local()
"""This thread's pinned() scope: the table keys brought up to date in it (`keys`) and the remote tables found
absent in it (`absent`), None outside one."""


@contextmanager
def pinned():
    """A scope in which each table is brought up to date once: the first open_table of its newest version reads
    the commits made since (a LIST and a GET on S3), later ones in the scope return the same copy as it is (it
    still advances by the writes made through it). For bookkeeping that reads tables nobody else writes while
    it runs (iteration_metrics: the iteration's stages are done), so each table costs one look-up, not one per
    read; a remote table found absent stays absent in the scope (one LIST, not one per table_exists) until this
    process opens it (write_partition looks for it again, and opens it once it created it). Scopes nest; per
    thread (in_this_scope carries one to another)."""
    outer, outer_absent = getattr(_PINNED, "keys", None), getattr(_PINNED, "absent", None)
    _PINNED.keys = set() if outer is None else outer
    _PINNED.absent = set() if outer_absent is None else outer_absent
    try:
        yield
    finally:
        _PINNED.keys, _PINNED.absent = outer, outer_absent


def in_this_scope(fn: Callable) -> Callable:
    """`fn`, to be called on another thread in this thread's pinned() scope: the two threads share its sets (a
    table brought up to date by one is up to date for the other, an absent one is absent for both). Outside a
    scope, `fn` itself: the other thread has none either."""
    keys, absent = getattr(_PINNED, "keys", None), getattr(_PINNED, "absent", None)
    if keys is None:
        return fn

    def scoped(*args, **kwargs):
        outer, outer_absent = getattr(_PINNED, "keys", None), getattr(_PINNED, "absent", None)
        _PINNED.keys, _PINNED.absent = keys, absent
        try:
            return fn(*args, **kwargs)
        finally:
            _PINNED.keys, _PINNED.absent = outer, outer_absent

    return scoped


def open_table(uri: str, *, version: int | None = None, storage_options: Options = None) -> DeltaTable:
    """The DeltaTable at `uri` (optionally at `version`), opened with the URI's storage options.

    The newest version comes from this process's open copy of the table, brought up to date incrementally: only
    the commits made since it was last used are read (DeltaTable.update_incremental). Opening a table reads its
    last checkpoint, whose file list holds every partition ever written, so opening it per look-up made every
    iteration's bookkeeping grow with the run (#36); after REOPEN_AFTER commits it is opened anew, as delta-rs
    replays every commit applied since the open. A `version` the open copy is at is that copy, read nothing
    (a version's state never changes); another version (time travel) is opened anew. The newest table is
    shared: read it or write through it, never load_as_version it. In a pinned() scope it is brought up to date
    once."""
    path, opts = _open(uri, storage_options)
    key, stamp = (path, json.dumps(opts or {}, sort_keys=True)), _created(path)
    pinned_keys = getattr(_PINNED, "keys", None)
    with _TABLES_LOCK:
        table, created, opened_at = _TABLES.get(key, (None, None, 0))
        current = table is not None and created == stamp
        if current and version is not None and version == table.version():
            return table
        if current:  # the version it is at, before it moves on: a read at it can take read_written's way
            commit_reads.remember((*key, stamp), table)
        if current and not (version is None and pinned_keys is not None and key in pinned_keys) and _newer(table, path):
            table.update_incremental()
        if table is None or created != stamp or _stale(table, opened_at):
            table = DeltaTable(path, storage_options=opts)
            _TABLES[key] = (table, stamp, table.version())
        commit_reads.remember((*key, stamp), table)
        if pinned_keys is not None:
            pinned_keys.add(key)
    if version is None or version == table.version():
        return table
    return DeltaTable(path, version=version, storage_options=opts)


def _newer(table: DeltaTable, path: str) -> bool:
    """Whether a commit was made after the open copy's version. Locally that is one stat of the next commit file
    (commits are numbered without gaps); delta-rs's update_incremental and is_deltatable list the whole _delta_log
    directory, one entry per commit ever made (8.7 ms at 1000 iterations against 0.15 ms at 10, #36). A remote
    table: True (update_incremental lists from the copy's version on, what a look-up costs anyway)."""
    if not uris.is_local(path):
        return True
    return (uris.local_path(path) / "_delta_log" / f"{table.version() + 1:020d}.json").exists()


def _remember_held(path: str, opts: dict[str, str] | None) -> None:
    """Remember the schema of the version this process's open copy of the table is at (commit_reads.remember), if
    it has one open: its own write left it there."""
    key, stamp = (path, json.dumps(opts or {}, sort_keys=True)), _created(path)
    with _TABLES_LOCK:
        table, created, _ = _TABLES.get(key, (None, None, 0))
        if table is not None and created == stamp:
            commit_reads.remember((*key, stamp), table)


WRITE_ATTEMPTS = 3
"""Commits of one write tried before its CommitFailedError is raised (write_through)."""


def write_through(
    uri: str, write: Callable[[DeltaTable], object], *, storage_options: Options = None, advances: bool = True
) -> int:
    """Make one commit, `write(table)`, through this process's open copy of the existing table at `uri`, and
    return the version it committed. `advances`: the write leaves the copy at that version (write_deltalake reads
    its own commit back); else (DeltaTable.create_write_transaction) the copy is brought up to date after it.

    A remote table's copy is not brought up to date first: on S3 that is a LIST and a GET of `_last_checkpoint`
    before each write, and a commit checks the commits made since its snapshot anyway. delta-rs commits after a
    concurrent write to another partition; one that added or removed files of the partition written, or changed
    the table's schema, fails the commit (CommitFailedError). Then the copy is brought up to date and `write`
    made again: last writer wins, as with a copy brought up to date first. A local copy is brought up to date by
    open_table (a stat of the next commit file)."""
    path, opts = _open(uri, storage_options)
    table = None if uris.is_local(path) else _held(path, opts)
    if table is None:
        table = open_table(uri, storage_options=storage_options)
    for attempt in range(1, WRITE_ATTEMPTS + 1):
        try:
            write(table)
            break
        except CommitFailedError:
            if attempt == WRITE_ATTEMPTS:
                raise
            with _TABLES_LOCK:
                table.update_incremental()
    if not advances:
        with _TABLES_LOCK:
            table.update_incremental()
    _remember_held(path, opts)  # the version it wrote: a read at it takes commit_reads' way
    return table.version()


def _held(path: str, opts: dict[str, str] | None) -> DeltaTable | None:
    """This process's open copy of the table, as it is, if it has one that open_table would not open anew."""
    key = (path, json.dumps(opts or {}, sort_keys=True))
    with _TABLES_LOCK:
        table, created, opened_at = _TABLES.get(key, (None, None, 0))
        if table is None or created != _created(path) or _stale(table, opened_at):
            return None
        return table


def commit_key(uri: str, storage_options: Options = None) -> tuple[str, tuple]:
    """(what delta-rs opens, the table's key) of the table at `uri` for stages.io.commit_reads, the version this
    process's open copy is at remembered first."""
    path, opts = _open(uri, storage_options)
    _remember_held(path, opts)
    return path, _key(path, opts)


def _key(path: str, opts: dict[str, str] | None) -> tuple:
    """A table's key in this process's caches: where, how it is opened, and which table is there (_created)."""
    return path, json.dumps(opts or {}, sort_keys=True), _created(path)


def _stale(table: DeltaTable, opened_at: int) -> bool:
    """Whether an open copy is opened anew: it absorbed more than REOPEN_AFTER commits, or a checkpoint was written
    since its open (delta-rs writes one after versions every-1, 2*every-1, ... for delta.checkpointInterval = every;
    a fresh open starts from it and replays nothing, while the copy replays every commit since the checkpoint it
    was opened from)."""
    version = table.version()
    every = int(table.metadata().configuration.get("delta.checkpointInterval", 100))
    return version - opened_at > REOPEN_AFTER or (version + 1) // every > (opened_at + 1) // every


def forget_tables() -> None:
    """Drop this process's open tables (the next open_table of each reads its checkpoint again)."""
    with _TABLES_LOCK:
        _TABLES.clear()


def table_exists(uri: str, *, storage_options: Options = None) -> bool:
    """Whether a Delta table is at `uri`. A remote table this process has open (open_table) exists without a
    look-up (a LIST on S3): rlake never deletes a table; in a pinned() scope, one found absent is absent without
    another. A local one is looked at, a test may delete it: one it has open whose first commit file is the one
    it opened (_created) exists; else delta-rs's is_deltatable looks (it lists the whole _delta_log directory:
    8.7 ms at 1000 iterations, #36)."""
    path, opts = _open(uri, storage_options)
    key, absent = (path, json.dumps(opts or {}, sort_keys=True)), getattr(_PINNED, "absent", None)
    with _TABLES_LOCK:
        held = _TABLES.get(key)
    if uris.is_local(path):  # the table this process has open, still there (its first commit file unchanged)
        stamp = _created(path)
        if held is not None and stamp is not None and held[1] == stamp:
            return True
        return DeltaTable.is_deltatable(path, storage_options=opts)
    if held is not None:
        return True
    if absent is not None and key in absent:
        return False
    found = DeltaTable.is_deltatable(path, storage_options=opts)
    if not found and absent is not None:
        absent.add(key)
    return found


def _forget_absent(path: str, opts: dict[str, str] | None) -> None:
    """Drop a table from this thread's pinned() set of absent tables (its next table_exists looks again)."""
    absent = getattr(_PINNED, "absent", None)
    if absent is not None:
        absent.discard((path, json.dumps(opts or {}, sort_keys=True)))


def to_arrow(name: str, df: pd.DataFrame) -> pa.Table:
    """Cast a DataFrame to the table's declared schema (fails loudly on a missing column)."""
    schema = SCHEMAS[name]
    fill = {k: [v] * len(df) for k, v in COLUMN_DEFAULTS.items() if k in schema.names and k not in df.columns}
    df = df.assign(**fill) if fill else df
    missing = [f.name for f in schema if f.name not in df.columns]
    if missing:
        raise ValueError(f"table '{name}': DataFrame lacks columns {missing}; has {list(df.columns)}")
    legacy = [f for f in LEGACY_FIELDS.get(name, ()) if f.name in df.columns]  # an older rlake's layout (tests)
    schema = pa.schema([*schema, *legacy]) if legacy else schema
    table = pa.Table.from_pandas(df[[f.name for f in schema]], schema=schema, preserve_index=False)
    for column in extra_columns(name, df):
        try:
            values = pa.array(df[column].tolist(), from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ValueError(f"table '{name}': extra column '{column}' holds values of mixed types: {exc}") from exc
        if values.null_count < len(values):  # an all-null column has no type Delta can store: left out
            table = table.append_column(column, values)
    return table


def extra_columns(name: str, df: pd.DataFrame) -> list[str]:
    """The columns beyond its schema that table `name` keeps (tables.EXTRA_COLUMNS), sorted; one that would
    replace a schema column is a ValueError."""
    if name not in EXTRA_COLUMNS or EXTRA_COLUMNS[name] not in df.columns:
        return []
    names = sorted({str(k) for keys in df[EXTRA_COLUMNS[name]] if keys is not None for k in keys})
    taken = [k for k in names if k in SCHEMAS[name].names or k in ("run_id", "iteration")]
    if taken:
        raise ValueError(f"table '{name}': extra columns {taken} would replace its own columns of the same names")
    missing = [k for k in names if k not in df.columns]
    if missing:
        raise ValueError(f"table '{name}': rows name extra columns {missing} the DataFrame lacks")
    return names


TABLE_CONFIGURATION = {
    "delta.enableExpiredLogCleanup": "false",
    "delta.dataSkippingNumIndexedCols": "0",
    "delta.checkpointInterval": "10",
}
"""Properties of every table rlake creates (`rlake maintain` sets them on older tables).
- The commit log IS rlake's lineage (each commit's rlake.* metadata), so it is never expired: delta-rs otherwise
  deletes commits older than delta.logRetentionDuration (30 days) whenever it writes its automatic checkpoint
  (every 100 commits), and with them the lineage and time travel of old iterations. Data files are only removed
  by `rlake maintain`'s VACUUM, which keeps every recorded version.
- No per-column min/max/null statistics in the log, only each file's numRecords: delta-rs processes the stats of
  every file of the table at each commit and open, so with them a write's time grew with the run's length
  (docs/benchmarks.md, "Row counts only"). Nothing reads them: rlake's reads are pruned by the (run_id,
  iteration) partition values, and `rlake sql` reads through pyarrow, which skips by the Parquet footers' own
  statistics.
- A checkpoint every 10 commits (Delta's own default; delta-rs's is 100): every write and every open replays the
  JSON commits since the newest checkpoint, so with 100 a write's cost rose and fell with the table's version
  (at 1,000 iterations, 12-30 ms per write; docs/benchmarks.md, "A checkpoint every 10 commits"). A checkpoint
  holds the table's file list, so they add up: `rlake maintain` deletes all but one per 100 versions
  (maintenance.prune_checkpoints)."""


def empty_partition_error(name: str, run_id: str, iteration: int) -> ValueError:
    """What every partition write raises instead of committing no rows."""
    return ValueError(
        f"refusing to write an empty partition of '{name}' (run {run_id}, iteration "
        f"{iteration}): an empty stage output means an upstream stage produced nothing"
    )


def missing_partition_error(
    uri: str, version: int | None, run_id: str, iteration: int, *, what: str = "rows"
) -> LookupError:
    """What every partition read raises when table `uri` at `version` (None: newest) has no such partition
    (`what` it found none of: rows, or the files a Dataset would read)."""
    at = "newest" if version is None else version
    return LookupError(
        f"table '{uri}' (version {at}) has no {what} for run '{run_id}' iteration {iteration}: "
        "materialize that partition of its asset first"
    )


def write_partition(
    uri: str,
    name: str,
    df: pd.DataFrame,
    *,
    run_id: str,
    iteration: int,
    lineage: dict[str, Any],
    storage_options: Options = None,
) -> int:
    """Replace partition (run_id, iteration) of table `name` at `uri`; returns the new version."""
    if not len(df):
        raise empty_partition_error(name, run_id, iteration)
    data = to_arrow(name, df.assign(run_id=run_id, iteration=iteration))
    props = CommitProperties(custom_metadata=commit_metadata(name, data, run_id, iteration, lineage))
    path, opts = _open(uri, storage_options)
    _forget_absent(path, opts)  # whether to create the table is looked up, never taken from a pinned() scope
    if not table_exists(uri, storage_options=storage_options):
        write_deltalake(
            path,
            data,
            mode="append",
            partition_by=["run_id", "iteration"],
            commit_properties=props,
            storage_options=opts,
            configuration=TABLE_CONFIGURATION,
        )
        return open_table(uri, storage_options=storage_options).version()
    safe_run = run_id.replace("'", "''")
    # schema_mode=merge: a table written by an older rlake gains the new columns (null in old rows)
    # instead of refusing a resumed run's writes
    return write_through(
        uri,
        lambda table: write_deltalake(
            table,
            data,
            mode="overwrite",
            predicate=f"run_id = '{safe_run}' AND iteration = {iteration}",
            commit_properties=props,
            schema_mode="merge",
        ),
        storage_options=storage_options,
    )


def commit_metadata(name: str, data: pa.Table, run_id: str, iteration: int, lineage: dict[str, Any]) -> dict[str, str]:
    """The rlake.* commit metadata of a write: the stage's lineage plus run, iteration, table, code version and
    the value sets of COMMIT_SETS columns. Never a storage option or credential."""
    meta = {LINEAGE_PREFIX + k: (v if isinstance(v, str) else json.dumps(v)) for k, v in lineage.items()}
    meta |= {
        LINEAGE_PREFIX + "run_id": run_id,
        LINEAGE_PREFIX + "iteration": str(iteration),
        LINEAGE_PREFIX + "table": name,
        LINEAGE_PREFIX + "code_version": code_version(),
    }
    for column, key in COMMIT_SETS.items():  # e.g. every reward version that scored the rows written
        if column in data.column_names:
            meta[LINEAGE_PREFIX + key] = json.dumps(sorted({v for v in data[column].to_pylist() if v is not None}))
    return meta


def read_partition(
    uri: str,
    run_id: str,
    iteration: int,
    *,
    version: int | None = None,
    columns: list[str] | None = None,
    storage_options: Options = None,
    filters: pc.Expression | None = None,
) -> pd.DataFrame:
    """Rows of one (run_id, iteration) partition, optionally at a table version (time travel), optionally only
    those matching `filters` (a pyarrow expression: an empty result is then no error)."""
    kw = {"version": version, "columns": columns, "storage_options": storage_options, "filters": filters}
    return read_partition_at(uri, run_id, iteration, **kw)[0]


def read_partition_at(
    uri: str,
    run_id: str,
    iteration: int,
    *,
    version: int | None = None,
    columns: list[str] | None = None,
    storage_options: Options = None,
    filters: pc.Expression | None = None,
) -> tuple[pd.DataFrame, int]:
    """(read_partition's rows, the table version they were read at: `version`, else the newest), one table open."""
    if not table_exists(uri, storage_options=storage_options):
        raise FileNotFoundError(f"no Delta table at '{uri}': materialize its asset first")
    if version is not None:  # the version's own commit, when it wrote the partition whole: no time travel (#36)
        kw = {"columns": columns, "filters": filters}
        df = commit_reads.read_written(*commit_key(uri, storage_options), run_id, iteration, version, **kw)
        if df is not None:
            if not len(df) and filters is None:
                raise missing_partition_error(uri, version, run_id, iteration)
            return df, version
    dt = open_table(uri, version=version, storage_options=storage_options)
    try:
        df = partition_dataset(dt, run_id, iteration).to_table(columns=columns, filter=filters).to_pandas()
    except FileNotFoundError:
        if version is not None:  # a recorded version VACUUM removed: say so (what, why, how to fix)
            from stages.io.maintenance import check_version_files  # noqa: PLC0415 - maintenance imports store

            check_version_files(uri, version, run_id=run_id, iteration=iteration, storage_options=storage_options)
        raise
    if not len(df) and filters is None:
        raise missing_partition_error(uri, dt.version(), run_id, iteration)
    return df, dt.version()


def partition_dataset(dt: DeltaTable, run_id: str, iteration: int) -> pads.FileSystemDataset:
    """Partition (run_id, iteration) of the open table `dt` as the pyarrow dataset DeltaTable.to_pandas reads, each
    small file read whole in one request (whole_reads: on S3 one GET, not one per column chunk)."""
    return whole_small_files(
        dt.to_pyarrow_dataset(partitions=[("run_id", "=", run_id), ("iteration", "=", str(iteration))]),
        table=dt.table_uri,
    )


def present_columns(
    uri: str, columns: Sequence[str] | None, *, version: int | None = None, storage_options: Options = None
) -> list[str]:
    """`columns` (None: every column) that the table at `uri` has at `version`, in their order: a table written by
    an older rlake may lack a newer column, which a read naming it would fail on."""
    known = None if version is None else commit_reads.schema_at(commit_key(uri, storage_options)[1], version)
    if known is None:  # a version this process never had open: its schema from a (time-travel) open
        known = open_table(uri, version=version, storage_options=storage_options).schema().to_arrow()
    names = known.names
    return list(names) if columns is None else [c for c in columns if c in set(names)]


def table_version(uri: str, *, storage_options: Options = None) -> int:
    return open_table(uri, storage_options=storage_options).version()


HISTORY_PAGE = 16
"""Commits the first DeltaTable.history(limit) call of a History reads; each further page doubles the limit."""


def lineage_of(entry: dict[str, Any], version: int) -> dict[str, Any] | None:
    """The rlake lineage of one history() entry (its rlake.* metadata, decoded, plus version and timestamp);
    None for a commit without any (written outside rlake)."""
    meta = {k[len(LINEAGE_PREFIX) :]: v for k, v in entry.items() if k.startswith(LINEAGE_PREFIX)}
    if not meta:
        return None
    for key in ("upstream", "write_nodes", "joins", *COMMIT_SETS.values()):
        if key in meta:
            meta[key] = json.loads(meta[key])
    return {"version": version, "timestamp": entry.get("timestamp"), **meta}


def of_partition(commit: dict[str, Any] | None, run_id: str | None, iteration: int | None) -> bool:
    """Whether a lineage commit wrote partition (run_id, iteration); None matches any run / iteration."""
    return (
        commit is not None
        and (run_id is None or commit.get("run_id") == run_id)
        and (iteration is None or commit.get("iteration") == str(iteration))
    )


_COMMITS: dict[tuple, dict[int, dict[str, Any] | None]] = {}
"""This process's commitInfo of each table version it has read (History), by table (_open's key and _created's
stamp): a commit file never changes, so each is read once per process. None: no such commit file."""
COMMITS_KEPT = 4096
"""Versions of one table _COMMITS keeps; past that it starts over."""
DIRECT_READS = 4
"""Commits a History page reads one file each (a GET of _delta_log/<version>.json) when the rest of the page is
known; more are read by one DeltaTable.history(limit) call."""


class History:
    """The rlake lineage of one table's commits, newest first, read on demand and page by page: finding a recent
    commit costs the same however long the history is (#36); reading it all costs one history() call.

    The table is opened once, at its newest version (delta-rs 1.x labels the history of a table opened at an older
    version wrongly); commits made after that are left out, even when they land between two pages. Each commit
    is read once per process (_COMMITS): a page whose commits were all read before reads nothing, one that lacks
    at most DIRECT_READS reads those commit files, else one DeltaTable.history(limit) call reads it."""

    def __init__(self, uri: str, *, storage_options: Options = None) -> None:
        self.table = open_table(uri, storage_options=storage_options)
        self.version = self.table.version()
        path, opts = _open(uri, storage_options)
        self._where = (path, opts)
        self._known = _COMMITS.setdefault(_key(path, opts), {})
        if len(self._known) > COMMITS_KEPT:
            self._known.clear()
        self._lineage: list[dict[str, Any] | None] = []  # lineage_of each commit read so far, newest first
        self._limit: int | None = HISTORY_PAGE
        self.complete = False

    def _more(self) -> bool:
        """Read the next page (all of the rest once `_limit` is None); False when everything is read."""
        top = self.version - len(self._lineage)  # the newest version not read yet
        if self.complete or top < 0:
            self.complete = True
            return False
        versions = range(top, -1 if self._limit is None else max(-1, top - self._limit), -1)
        missing = [v for v in versions if v not in self._known]
        if len(missing) > DIRECT_READS:
            self._read_history(top, len(versions))
        for v in missing if len(missing) <= DIRECT_READS else ():
            self._known[v] = self._read_commit(v)
        self._lineage += [lineage_of(self._known.get(v) or {}, v) for v in versions]
        self.complete = versions[-1] == 0
        self._limit = None if self._limit is None else self._limit * 2
        return True

    def _read_history(self, top: int, count: int) -> None:
        """Commits top, top-1, ... (count of them) by one history() call, into _COMMITS (a version without a commit
        file: None)."""
        # delta-rs numbers history() entries down from the table's loaded version, but reads the newest commits in
        # storage: read it through this process's open copy brought up to date (self.table may have been replaced
        # by a fresh open since: after REOPEN_AFTER commits or a checkpoint), and skip what landed since our open
        path, opts = self._where
        table = open_table(path, storage_options=opts)
        newer = table.version() - top
        entries = table.history(None if count > top else newer + count)
        found = {int(e["version"]): {k: v for k, v in e.items() if k != "version"} for e in entries}
        for v in range(top, top - count, -1):
            self._known[v] = found.get(v)

    def _read_commit(self, v: int) -> dict[str, Any] | None:
        """The commitInfo of version v's commit file (what history() gives for it, without the version)."""
        return read_commit_info(*self._where, v)

    def commits(self, *, everything: bool = False):
        """Lineage commits newest first, reading pages as the caller goes on (`everything`: in one read)."""
        if everything:
            self._limit = None
        i = 0
        while i < len(self._lineage) or self._more():
            if i < len(self._lineage):
                if self._lineage[i] is not None:
                    yield self._lineage[i]
                i += 1

    def find(
        self,
        run_id: str | None = None,
        iteration: int | None = None,
        *,
        limit: int | None = None,
        since_version: int | None = None,
    ) -> list[dict[str, Any]]:
        """Commits of (run_id, iteration) newest first: at most `limit`, none older than `since_version`."""
        out = []
        for commit in self.commits(everything=limit is None and since_version is None):
            if since_version is not None and commit["version"] < since_version:
                break
            if of_partition(commit, run_id, iteration):
                out.append(commit)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def commit(self, version: int) -> dict[str, Any] | None:
        """The lineage of the commit at `version` (None: no such commit, or not an rlake one)."""
        for commit in self.commits() if 0 <= version <= self.version else ():
            if commit["version"] <= version:
                return commit if commit["version"] == version else None
        return None

    def has_partition(self, run_id: str, iteration: int) -> bool:
        """Whether the newest version holds rows of (run_id, iteration). rlake replaces a partition and never
        deletes one (an empty write is refused), so a partition without rows has no commit to look for."""
        where = [("run_id", "=", run_id), ("iteration", "=", str(iteration))]
        return bool(self.table.partitions(file_pruning_predicate=where))

    def newest(self, run_id: str, iteration: int) -> dict[str, Any] | None:
        """The newest commit of partition (run_id, iteration): the pages down to it, none when it has no rows."""
        found = self.find(run_id, iteration, limit=1) if self.has_partition(run_id, iteration) else []
        return found[0] if found else None


def read_commit_info(path: str, opts: dict[str, str] | None, version: int) -> dict[str, Any] | None:
    """The commitInfo of the table's commit file of `version` (None: no such file, or none in it)."""
    from stages.io import objects  # noqa: PLC0415 - objects is only needed here

    data = objects.get_bytes(objects.open_store(path, opts), f"_delta_log/{version:020d}.json")
    for line in (data or b"").decode().splitlines():
        action = json.loads(line) if line.strip() else {}
        if "commitInfo" in action:
            return action["commitInfo"]
    return None


def commit_at(uri: str, version: int, *, storage_options: Options = None) -> dict[str, Any] | None:
    """The rlake lineage of the commit at `version` (its one commit file read, once per process); None when there
    is none or it is not an rlake commit."""
    path, opts = _open(uri, storage_options)
    known = _COMMITS.setdefault(_key(path, opts), {})
    if version not in known:
        found = read_commit_info(path, opts, version)
        if found is None:  # not (yet) committed: a later look-up reads the file again
            return None
        known[version] = found
    return lineage_of(known[version] or {}, version)


def commit_lineage(
    uri: str,
    *,
    run_id: str | None = None,
    iteration: int | None = None,
    limit: int | None = None,
    since_version: int | None = None,
    storage_options: Options = None,
) -> list[dict[str, Any]]:
    """The rlake lineage of every commit (newest first), optionally for one run / iteration. With `limit` (at
    most that many) or `since_version` (none older), only the newest pages of the history are read (History)."""
    history = History(uri, storage_options=storage_options)
    return history.find(run_id, iteration, limit=limit, since_version=since_version)


def newest_commit(uri: str, run_id: str, iteration: int, *, storage_options: Options = None) -> dict[str, Any] | None:
    """The newest commit of partition (run_id, iteration) of the table at `uri`; None when it has none (or there
    is no table). Reads the history only down to that commit."""
    if not table_exists(uri, storage_options=storage_options):
        return None
    return History(uri, storage_options=storage_options).newest(run_id, iteration)


def first_commit_of(
    uri: str, versions: list[int], run_id: str, iteration: int, *, storage_options: Options = None
) -> int | None:
    """The first of `versions` whose commit wrote partition (run_id, iteration) of the table at `uri`; None when
    none did (or there is no table). Reads each version's own commit file (commit_at: once per process), neither
    the table's log nor its state: a look-up of a table this process has just committed lists nothing (on S3 it
    was a LIST and a GET per look-up, #37), and a version no commit file has (yet) is not that commit."""
    if not versions or not table_exists(uri, storage_options=storage_options):
        return None
    for v in versions:
        if v >= 0 and of_partition(commit_at(uri, v, storage_options=storage_options), run_id, iteration):
            return v
    return None
