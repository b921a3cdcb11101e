"""Reading partition (run_id, iteration) at the version whose commit wrote it, from that commit alone (#36).

Time travel (`DeltaTable(path, version=v)`) loads version v's whole state: the log listing, the checkpoint at or
before v (one row per file of the table) and the commits after it; at 1000 iterations that is ~65 ms per open,
against ~3 ms at 10. A recorded version is nearly always the one whose commit wrote the partition read, and when
that commit replaced the whole partition, the partition at v is exactly the commit's add actions: one JSON file,
whatever the table's history. `read_written` reads it so, and returns None (the caller opens the version as
before) whenever that is not exactly right:

- the table's schema at v is not known: this process saw its open copy at v (`remember`, called by
  store.open_table), else None (a version's schema never changes, so a remembered one is exact);
- the commit is not an rlake write of that partition (rlake.run_id / rlake.iteration), or not one that replaced it
  whole: an Overwrite with no predicate (a whole-table overwrite, or dataset_io.commit_files' partition_filters)
  or with exactly store.write_partition's predicate, or the table's first commit; an append, merge, delete,
  OPTIMIZE or any other commit at v falls back;
- an add action is for another partition, has a deletion vector, or names a file by absolute URI;
- a file is missing (the fallback raises what it raises today, maintenance.check_version_files' VACUUM error);
- the table is not local (object-store reads go the delta-rs way), or its protocol has reader features.

The rows are read as delta-rs reads them (DeltaTable.to_pyarrow_dataset): the same Parquet format options, the
table's schema at v (a file without a newer column gives nulls), the partition columns from the partition values.
"""

from __future__ import annotations

import json
import threading
from urllib.parse import unquote

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pa_fs

from stages.io import uris

_SCHEMAS: dict[tuple, dict[int, pa.Schema]] = {}
"""The table schema (as to_pyarrow_dataset uses it) of each version this process's open copy of a table was at,
by table (store.open_table's key and creation stamp); None: a version whose protocol has reader features."""
_LOCK = threading.Lock()
SCHEMAS_KEPT = 4096
"""Versions of one table _SCHEMAS keeps; past that it starts over."""


def remember(table_key: tuple, table) -> None:
    """Record the schema of the DeltaTable `table` at its version (what store.open_table's copy is at now)."""
    version = table.version()
    with _LOCK:
        known = _SCHEMAS.setdefault(table_key, {})
        if version in known:
            return
        protocol = table.protocol()
        exact = protocol.min_reader_version < 2 and not protocol.reader_features
        schema = pa.schema(table.schema().to_arrow()) if exact else None
        if table.version() != version:  # a write through the shared copy moved it meanwhile: not this version's
            return
        if len(known) > SCHEMAS_KEPT:
            known.clear()
        known[version] = schema


def schema_at(table_key: tuple, version: int) -> pa.Schema | None:
    """The remembered schema of the table at `version` (None: not seen at it, or not readable this way)."""
    with _LOCK:
        return _SCHEMAS.get(table_key, {}).get(version)


def partition_predicate(run_id: str, iteration: int) -> str:
    """The predicate store.write_partition replaces a partition with (its commit records it verbatim)."""
    return f"run_id = '{run_id.replace(chr(39), chr(39) * 2)}' AND iteration = {iteration}"


def _replaces_partition(commit: dict, version: int, run_id: str, iteration: int) -> bool:
    """Whether commitInfo `commit` is an rlake write of (run_id, iteration) that replaced the partition whole."""
    if commit.get("rlake.run_id") != run_id or commit.get("rlake.iteration") != str(iteration):
        return False
    params = commit.get("operationParameters") or {}
    if version == 0:  # the table's first commit: no partition before it
        return commit.get("operation") in ("WRITE", "CREATE TABLE")
    if commit.get("operation") != "WRITE" or params.get("mode") != "Overwrite":
        return False
    return params.get("predicate") in (None, partition_predicate(run_id, iteration))


def written_adds(log: bytes, version: int, run_id: str, iteration: int) -> list[dict] | None:
    """The add actions (paths unquoted) by which commit `version` (its JSON, `log`) wrote (run_id, iteration), when
    that commit replaced the whole partition with them; None otherwise."""
    commit, adds, values = None, [], {"run_id": run_id, "iteration": str(iteration)}
    for line in log.decode().splitlines():
        action = json.loads(line) if line.strip() else {}
        if "commitInfo" in action:
            commit = action["commitInfo"]
        add = action.get("add")
        if add is not None:
            path = add.get("path", "")
            if add.get("partitionValues") != values or add.get("deletionVector") or "://" in path:
                return None
            adds.append(add | {"path": unquote(path)})
    if commit is None or not adds or not _replaces_partition(commit, version, run_id, iteration):
        return None
    return adds


def _written(path: str, table_key: tuple, run_id: str, iteration: int, version: int):
    """(the table's schema at `version`, the add actions of the files its commit wrote the partition with), when the
    commit wrote it whole and every file is there; None otherwise (the module docstring)."""
    schema = schema_at(table_key, version)
    if schema is None or not uris.is_local(path):
        return None
    root = uris.local_path(path)
    try:
        log = (root / "_delta_log" / f"{version:020d}.json").read_bytes()
    except OSError:
        return None
    adds = written_adds(log, version, run_id, iteration)
    if adds is None or not all((root / a["path"]).is_file() for a in adds):
        return None
    return schema, adds


def written_dataset(path: str, table_key: tuple, run_id: str, iteration: int, version: int) -> pads.Dataset | None:
    """The partition (run_id, iteration) of the local table at `path` as of `version`, as a pyarrow dataset built as
    DeltaTable(path, version=version).to_pyarrow_dataset(partition) builds it (format options, the table's schema
    at `version`, the partition columns from the partition values), from that version's commit alone; None when that
    is not exactly right (the module docstring), and the caller opens the version the delta-rs way."""
    found = _written(path, table_key, run_id, iteration, version)
    if found is None:
        return None
    schema, adds = found
    fmt = pads.ParquetFileFormat(default_fragment_scan_options=pads.ParquetFragmentScanOptions(pre_buffer=True))
    keys = (pc.field("run_id") == pa.scalar(run_id, schema.field("run_id").type)) & (
        pc.field("iteration") == pa.scalar(iteration, schema.field("iteration").type)
    )
    fs = pa_fs.SubTreeFileSystem(str(uris.local_path(path)), pa_fs.LocalFileSystem())
    fragments = [fmt.make_fragment(a["path"], filesystem=fs, partition_expression=keys) for a in adds]
    return pads.FileSystemDataset(fragments, schema, fmt, fs)


def written_rows(path: str, table_key: tuple, run_id: str, iteration: int, version: int) -> int | None:
    """The rows of the partition as of `version` from its commit's numRecords stats (what stage_exec.partition_rows
    sums from the version's add actions); None when not exactly right, or a file has no such stats."""
    found = _written(path, table_key, run_id, iteration, version)
    counts = [json.loads(a.get("stats") or "{}").get("numRecords") for a in found[1]] if found else [None]
    return None if any(c is None for c in counts) else int(sum(counts))


def read_written(
    path: str,
    table_key: tuple,
    run_id: str,
    iteration: int,
    version: int,
    *,
    columns: list[str] | None = None,
    filters: pc.Expression | None = None,
) -> pd.DataFrame | None:
    """The rows of (run_id, iteration) as of `version` from written_dataset, as DeltaTable(path, version).to_pandas(
    partitions=..., columns, filters) reads them; None when that is not exactly right."""
    dataset = written_dataset(path, table_key, run_id, iteration, version)
    return None if dataset is None else dataset.to_table(columns=columns, filter=filters).to_pandas()
