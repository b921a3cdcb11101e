"""Delta partitions as Ray Datasets: read on the workers, write from the workers, one commit by the caller.

The driver-side store (stages/io/store.py) reads a whole partition into a pandas DataFrame in the Dagster
step and writes it from there. Here the rows never pass through the caller:

- `read_partition_dataset` resolves the partition's files at a recorded table version (the Delta log: a
  few KB on the caller) and returns a Dataset whose read tasks fetch those Parquet files from the table's
  storage (file:// or s3://, through obstore) on whichever node runs them;
- `write_partition_dataset` casts each block to the table's schema and writes it as a Parquet file into the
  partition's directory from the task that holds it; the caller gathers only the file list (path, size,
  row count, the values of the commit-set columns) and makes ONE Delta commit that replaces the partition
  `(run_id, iteration)`, with rlake's lineage metadata. A block that fails leaves at most orphan files that
  no commit names (Delta readers never see them; VACUUM removes them), never a half-written partition.

Same table layout, schema, partitioning and commit metadata as store.write_partition, so every reader,
lineage walk, replay and resume works unchanged on partitions written either way.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
import ray.data
from deltalake import CommitProperties, DeltaTable
from deltalake import Schema as DeltaSchema
from deltalake.transaction import AddAction, create_table_with_add_actions

from stages.io import objects, uris
from stages.io.store import (
    LINEAGE_PREFIX,
    TABLE_CONFIGURATION,
    Options,
    _forget_absent,
    _open,
    code_version,
    empty_partition_error,
    missing_partition_error,
    open_table,
    table_exists,
    to_arrow,
    write_through,
)
from stages.io.tables import COMMIT_SETS

KEYS = ("run_id", "iteration")
"""The partition columns: in the Delta log's partition values, not in the Parquet files."""


def _store(uri: str, storage_options: Options):
    return objects.open_store(uris.target(uri), uris.options_of(uri, storage_options))


def partition_actions(
    uri: str, run_id: str, iteration: int, *, version: int | None = None, storage_options: Options = None
) -> dict[str, list]:
    """The Delta log's add actions (flattened: path, size, num_records, ...) of the files of partition
    (run_id, iteration) at `version`, column by column: the log's file list, a few KB, no data read."""
    dt = open_table(uri, version=version, storage_options=storage_options)
    actions = pa.table(dt.get_add_actions(flatten=True))  # an arro3 table: via the C data interface
    mine = pc.and_(
        pc.equal(actions["partition.run_id"], run_id),
        pc.equal(pc.cast(actions["partition.iteration"], pa.int64()), iteration),
    )  # filtered in Arrow: the table's file list holds every partition ever written
    return actions.filter(mine).to_pydict()


def partition_files(
    uri: str, run_id: str, iteration: int, *, version: int | None = None, storage_options: Options = None
) -> list[str]:
    """Paths (relative to the table root) of the Parquet files of partition (run_id, iteration) at `version`."""
    return partition_actions(uri, run_id, iteration, version=version, storage_options=storage_options)["path"]


def _read_files(batch: dict[str, Any], *, uri: str, options: dict | None, columns: list[str] | None) -> pa.Table:
    """One read task: the listed Parquet files of a partition, with the partition columns put back; `columns`
    (None: all) those of them each file has (a column a file lacks is left out of its rows, as a read of all
    columns leaves it out)."""
    store = _store(uri, options)
    tables = []
    for rel, run_id, iteration in zip(batch["path"], batch["run_id"], batch["iteration"], strict=True):
        data = objects.get_bytes(store, str(rel))
        if data is None:
            raise FileNotFoundError(f"Delta file '{rel}' of table '{uri}' is missing (vacuumed too early?)")
        cols = None
        if columns is not None:  # the file's footer says which it has: pyarrow raises on a column it lacks
            has = set(pq.read_schema(io.BytesIO(data)).names)
            cols = [c for c in columns if c not in KEYS and c in has]
        t = pq.read_table(io.BytesIO(data), columns=cols)
        t = t.append_column("run_id", pa.array([str(run_id)] * len(t), pa.string()))
        tables.append(t.append_column("iteration", pa.array([int(iteration)] * len(t), pa.int64())))
    return pa.concat_tables(tables, promote_options="permissive")


def read_file_records(uri: str, files: pd.DataFrame, columns: list[str] | None = None) -> pd.DataFrame:
    """The rows of files written for a commit (write_block's records; not committed yet, or committed): `columns`
    of them (None: all), in the records' order, without the partition columns."""
    path, options = uris.target(uri), uris.options_of(uri)
    batch = {"path": list(files["path"]), "run_id": [""] * len(files), "iteration": [0] * len(files)}
    table = _read_files(batch, uri=path, options=options, columns=columns)
    return table.drop_columns(list(KEYS)).to_pandas()


def read_partition_dataset(
    uri: str,
    run_id: str,
    iteration: int,
    *,
    version: int | None = None,
    columns: list[str] | None = None,
    storage_options: Options = None,
    files: list[str] | None = None,
) -> ray.data.Dataset:
    """A Dataset of partition (run_id, iteration) of the table at `uri` as of `version` (newest when None):
    one read task per Parquet file; `columns` projects in the files (those a file has: _read_files; the partition
    columns always come). `files`: the partition's files at `version` when the caller has listed them already
    (partition_files)."""
    if files is None:
        if not table_exists(uri, storage_options=storage_options):
            raise FileNotFoundError(f"no Delta table at '{uri}': materialize its asset first")
        files = partition_files(uri, run_id, iteration, version=version, storage_options=storage_options)
    if not files:
        raise missing_partition_error(uri, version, run_id, iteration, what="files")
    listing = ray.data.from_items([{"path": p, "run_id": run_id, "iteration": iteration} for p in files])
    return listing.map_batches(
        _read_files,
        batch_size=1,
        batch_format="numpy",
        fn_kwargs={"uri": uris.target(uri), "options": uris.options_of(uri, storage_options), "columns": columns},
    )


def _stats(table: pa.Table) -> str:
    """Delta file statistics: the row count only, as delta-rs writes them under TABLE_CONFIGURATION's
    delta.dataSkippingNumIndexedCols=0 (no per-column statistics: see there)."""
    return json.dumps({"numRecords": table.num_rows, "minValues": {}, "maxValues": {}, "nullCount": {}})


def write_block(df: pd.DataFrame, *, uri: str, options: dict | None, name: str, run_id: str, iteration: int):
    """One write task: the block cast to the table's schema, one Parquet file in the partition's directory;
    returns its file record (one row) for the caller's commit."""
    table = to_arrow(name, df.assign(run_id=run_id, iteration=iteration)).drop_columns(list(KEYS))
    # no pandas metadata in the file: a Ray Data block's ArrowDtype names ('list<item: int32>[pyarrow]') are not
    # dtypes pandas can parse back, and a whole-partition read (the Delta schema) never had them
    table = table.replace_schema_metadata(None)
    rel = f"run_id={run_id}/iteration={iteration}/part-{uuid.uuid4().hex}.parquet"
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="snappy")
    objects.put_bytes(_store(uri, options), rel, buf.getvalue())
    sets = {
        key: sorted({str(v) for v in table[col].to_pylist() if v is not None})
        for col, key in COMMIT_SETS.items()
        if col in table.column_names
    }
    return pd.DataFrame(
        {
            "path": [rel],
            "size": [buf.tell()],
            "rows": [table.num_rows],
            "stats": [_stats(table)],
            "schema": [table.schema.serialize().to_pybytes()],
            "sets": [json.dumps(sets)],
            "node": [ray.get_runtime_context().get_node_id() if ray.is_initialized() else None],
        }
    )


def _merged_schema(serialized: list[bytes]) -> pa.Schema:
    """The union of the blocks' schemas (a custom reward's extra columns may appear in some blocks only)."""
    schemas = [pa.ipc.read_schema(pa.py_buffer(s)) for s in serialized]
    return pa.unify_schemas(schemas, promote_options="permissive")


def _commit_metadata(name: str, run_id: str, iteration: int, lineage: Mapping[str, Any], sets: dict) -> dict:
    meta = {LINEAGE_PREFIX + k: (v if isinstance(v, str) else json.dumps(v)) for k, v in lineage.items()}
    meta |= {
        LINEAGE_PREFIX + "run_id": run_id,
        LINEAGE_PREFIX + "iteration": str(iteration),
        LINEAGE_PREFIX + "table": name,
        LINEAGE_PREFIX + "code_version": code_version(),
    }
    return meta | {LINEAGE_PREFIX + key: json.dumps(sorted(values)) for key, values in sets.items()}


def write_partition_dataset(
    ds: ray.data.Dataset,
    uri: str,
    name: str,
    *,
    run_id: str,
    iteration: int,
    lineage: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    storage_options: Options = None,
) -> int:
    """Replace partition (run_id, iteration) of table `name` at `uri` with the rows of `ds`, written by the
    workers; one atomic Delta commit with rlake's lineage (or a function giving it, called once the files are
    written: e.g. with the stage's duration). Returns the new table version."""
    options = uris.options_of(uri, storage_options)
    files = ds.map_batches(
        write_block,
        batch_format="pandas",
        batch_size=None,
        fn_kwargs={"uri": uris.target(uri), "options": options, "name": name, "run_id": run_id, "iteration": iteration},
    ).to_pandas()  # one small row per written file: the only thing that reaches the caller
    files = files[files["rows"] > 0] if "rows" in files else files  # no block at all: no columns either
    if not len(files):
        raise empty_partition_error(name, run_id, iteration)
    return commit_files(
        uri, name, files, run_id=run_id, iteration=iteration, lineage=lineage, storage_options=storage_options
    )


def _files_commit_properties(
    name: str, files: pd.DataFrame, run_id: str, iteration: int, lineage: Mapping[str, Any]
) -> CommitProperties:
    """The commit metadata of written files: rlake's lineage, the value sets the files' rows hold (COMMIT_SETS) and
    the Ray nodes whose tasks or ranks wrote them (where the stage's work ran)."""
    sets: dict[str, set] = {}
    for raw in files["sets"]:
        for key, values in json.loads(raw).items():
            sets.setdefault(key, set()).update(values)
    meta = _commit_metadata(name, run_id, iteration, lineage, sets)
    nodes = sorted({n for n in files.get("node", pd.Series(dtype=object)) if isinstance(n, str)})
    if nodes:
        meta[LINEAGE_PREFIX + "write_nodes"] = json.dumps(nodes)
    return CommitProperties(custom_metadata=meta)


def commit_files(uri: str, name: str, files: pd.DataFrame, *, run_id, iteration, lineage, storage_options) -> int:
    """ONE Delta commit of the written files (one row each), replacing partition (run_id, iteration); `lineage`
    a mapping or a function giving it (called here, after the files are written)."""
    schema = _merged_schema(list(files["schema"]))
    keys = [pa.field("run_id", pa.string(), nullable=False), pa.field("iteration", pa.int64(), nullable=False)]
    full = pa.schema([*keys, *schema])  # the partition columns first, as tables.SCHEMAS and store.write_partition
    now = int(time.time() * 1000)
    parts = {"run_id": run_id, "iteration": str(iteration)}
    actions = [
        AddAction(path=p, size=int(s), partition_values=parts, modification_time=now, data_change=True, stats=st)
        for p, s, st in zip(files["path"], files["size"], files["stats"], strict=True)
    ]
    props = _files_commit_properties(name, files, run_id, iteration, lineage() if callable(lineage) else lineage)
    path, opts = _open(uri, storage_options)
    _forget_absent(path, opts)  # whether to create the table is looked up, never taken from a pinned() scope
    if not table_exists(uri, storage_options=storage_options):  # an open local table: a stat, not a log listing
        create_table_with_add_actions(
            path,
            DeltaSchema.from_arrow(full),
            actions,
            mode="append",
            partition_by=list(KEYS),
            storage_options=opts,
            commit_properties=props,
            configuration=TABLE_CONFIGURATION,
        )
        return open_table(uri, storage_options=storage_options).version()

    def commit(dt: DeltaTable) -> None:
        # the commit's schema is the table's: the union keeps columns other partitions have (a custom reward's
        # extra keys of earlier iterations) and adds this write's new ones, as store.write_partition's merge
        schema = pa.unify_schemas([pa.schema(dt.schema().to_arrow()), full], promote_options="permissive")
        dt.create_write_transaction(
            actions,
            mode="overwrite",
            schema=schema,
            partition_by=list(KEYS),
            partition_filters=[("run_id", "=", run_id), ("iteration", "=", str(iteration))],
            commit_properties=props,
        )

    return write_through(uri, commit, storage_options=storage_options, advances=False)
