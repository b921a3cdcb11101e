"""One executor for table stages: a batch callable over an upstream partition at a recorded version, its output
written as Parquet files into the target partition with ONE Delta commit; the whole partition is never in the
caller (the Dagster step), whichever of the two modes runs it.

- in-process (`mode="local"`): the caller iterates the partition's record batches (`batch_rows` rows each,
  pyarrow's dataset over the Delta files at that version, no read-ahead), applies the callable to each, writes
  each output batch as one Parquet file into the partition's directory (dataset_io's write task, here), then
  commits. Its peak is one batch in, one batch out: no Ray Data start-up (~6 s on a process's first call,
  0.2-0.45 s warm), which a tiny CPU iteration of ~2 s cannot pay.
- Ray Data (`mode="ray"`): read_partition_dataset → map_batches(callable) → write_partition_dataset: read,
  compute and write on the workers, the caller gathers one small row per written file.

`choose_mode` picks Ray Data when the partition holds at least `data_min_rows` rows (ray.data_min_rows), counted
from the Delta log's add-action stats (no row is read). Both modes write the same layout, schema and lineage
metadata as store.write_partition, so readers, lineage walks, replay and resume cannot tell them apart.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import ray

from stages.io import commit_reads, dataset_io, store, uris
from stages.io.store import Options

BATCH_ROWS = 4096
"""Rows per in-process batch: a tiny run's partition is one batch (the stage sees what it saw whole)."""

READ_BUFFER = 1 << 20
"""Bytes of a Parquet file read at a time (without it pyarrow fetches each column chunk whole)."""

BatchFn = Callable[[pd.DataFrame], pd.DataFrame]
Lineage = Mapping[str, Any] | Callable[[float], Mapping[str, Any]]
"""Commit metadata, or a function of the seconds the stage ran (read, compute, file writes) that gives it."""


@dataclass(frozen=True)
class StageRun:
    """What one executor call did: the target table's new version, the source partition's rows, the mode."""

    version: int
    rows: int
    mode: str


def partition_rows(
    uri: str, run_id: str, iteration: int, *, version: int | None = None, storage_options: Options = None
) -> int:
    """Rows of partition (run_id, iteration) at `version`, summed from the add actions' numRecords stats."""
    if version is not None:  # the version's own commit, when it wrote the partition whole: no time travel (#36)
        rows = commit_reads.written_rows(*store.commit_key(uri, storage_options), run_id, iteration, version)
        if rows is not None:
            return rows
    actions = dataset_io.partition_actions(uri, run_id, iteration, version=version, storage_options=storage_options)
    counts = actions.get("num_records", [])
    if any(c is None for c in counts):  # a file written without stats: count its rows (metadata only)
        return sum(f.count_rows() for f in _dataset(uri, run_id, iteration, version, storage_options).get_fragments())
    return int(sum(counts))


def choose_mode(rows: int, data_min_rows: int | None) -> str:
    """ "ray" (Ray Data) from `data_min_rows` rows on, else "local" (in-process streaming); None: always local."""
    return "ray" if data_min_rows is not None and rows >= data_min_rows else "local"


def _dataset(uri: str, run_id: str, iteration: int, version: int | None, storage_options: Options) -> pads.Dataset:
    if version is not None:  # the version's own commit, when it wrote the partition whole: no time travel (#36)
        ds = commit_reads.written_dataset(*store.commit_key(uri, storage_options), run_id, iteration, version)
        if ds is not None:
            return ds
    return store.partition_dataset(
        store.open_table(uri, version=version, storage_options=storage_options), run_id, iteration
    )


def iter_partition_batches(
    uri: str,
    run_id: str,
    iteration: int,
    *,
    version: int | None = None,
    columns: list[str] | None = None,
    batch_rows: int | None = None,
    storage_options: Options = None,
    fill_missing: bool = True,
) -> Iterator[pd.DataFrame]:
    """The partition's rows at `version`, `batch_rows` at a time (None: BATCH_ROWS) as pandas, without the
    partition columns: iter_partition_record_batches, each batch converted."""
    for batch in iter_partition_record_batches(
        uri,
        run_id,
        iteration,
        version=version,
        columns=columns,
        batch_rows=batch_rows,
        storage_options=storage_options,
        fill_missing=fill_missing,
    ):
        yield batch.to_pandas()


def iter_partition_record_batches(
    uri: str,
    run_id: str,
    iteration: int,
    *,
    version: int | None = None,
    columns: list[str] | None = None,
    batch_rows: int | None = None,
    storage_options: Options = None,
    fill_missing: bool = True,
) -> Iterator[pa.RecordBatch]:
    """The partition's rows at `version`, `batch_rows` at a time (None: BATCH_ROWS) as Arrow record batches,
    without the partition columns; `columns` projects (those the table lacks are left out, those a file lacks
    come as nulls, as in a whole-partition read; with fill_missing=False those a file lacks are left out of its
    batches too, as a read without `columns` leaves them); one batch in memory at a time. Each file is read through a
    READ_BUFFER stream, page by page (pyarrow's ParquetFile, no pre-buffering): a dataset scanner decodes a whole
    row group first, and a driver-written partition is ONE row group, so its peak grew with the partition
    (reading 20k rollouts of 256 tokens, 1000-row batches, against 1k: +270 MB with a scanner, +55 MB
    unbuffered, +27 MB buffered)."""
    ds, pool = _dataset(uri, run_id, iteration, version, storage_options), pa.default_memory_pool()
    for fragment in ds.get_fragments():
        with ds.filesystem.open_input_file(fragment.path) as f:
            reader = pq.ParquetFile(f, pre_buffer=False, buffer_size=READ_BUFFER)
            wanted = _columns_of(ds.schema, reader.schema_arrow, columns, fill_missing)
            have = [c for c in wanted if c in reader.schema_arrow.names]
            for batch in reader.iter_batches(batch_size=batch_rows or BATCH_ROWS, columns=have, use_threads=False):
                if batch.num_rows:  # without pandas metadata, as a whole read (the Delta schema has none)
                    yield _with_nulls(batch, ds.schema, wanted).replace_schema_metadata(None)
                pool.release_unused()  # else mimalloc keeps the decoded batches' pages (+40 MB over 100k rollouts)


def _columns_of(table: pa.Schema, file: pa.Schema, columns: list[str] | None, fill_missing: bool = True) -> list[str]:
    """The columns a batch of one file holds, as a whole-partition read (DeltaTable.to_pandas) would have them:
    `columns` the table has (None: the file's), plus the table's columns an older file lacks when `columns` asks
    (fill_missing; else only those of `columns` the file has, as a read of all its columns would hold them)."""
    if columns is None:
        return list(file.names)
    held = table.names if fill_missing else file.names
    return [c for c in columns if c in held and c not in dataset_io.KEYS]


def _with_nulls(batch: pa.RecordBatch, table: pa.Schema, wanted: list[str]) -> pa.RecordBatch:
    """`batch` with the `wanted` columns in that order, those its file lacks (written before the table's schema
    gained them) as nulls of the table's type, as the Delta reader fills them."""
    if batch.schema.names == wanted:
        return batch
    arrays = [
        batch.column(c) if c in batch.schema.names else pa.nulls(batch.num_rows, table.field(c).type) for c in wanted
    ]
    return pa.RecordBatch.from_arrays(arrays, names=wanted)


@dataclass(frozen=True)
class Partition:
    """Partition (run_id, iteration) of the table at `uri` as of `version` (None: newest): what a stage reads."""

    uri: str
    run_id: str
    iteration: int
    version: int | None
    storage_options: Options = None

    def batches(self, columns: list[str] | None = None, batch_rows: int | None = None) -> Iterator[pd.DataFrame]:
        """iter_partition_batches of this partition: record_batches, each converted to pandas."""
        return (batch.to_pandas() for batch in self.record_batches(columns, batch_rows))

    def record_batches(
        self, columns: list[str] | None = None, batch_rows: int | None = None
    ) -> Iterator[pa.RecordBatch]:
        """iter_partition_record_batches of this partition."""
        return iter_partition_record_batches(
            self.uri,
            self.run_id,
            self.iteration,
            version=self.version,
            columns=columns,
            batch_rows=batch_rows,
            storage_options=self.storage_options,
        )

    def read(self, columns: list[str]) -> pd.DataFrame:
        """read_columns of this partition."""
        return read_columns(
            self.uri, self.run_id, self.iteration, columns, version=self.version, storage_options=self.storage_options
        )

    def arrow(self, columns: list[str]) -> pa.Table:
        """These columns of the partition as one Arrow table (compact buffers, no Python objects)."""
        return _dataset(self.uri, self.run_id, self.iteration, self.version, self.storage_options).to_table(
            columns=columns
        )

    def columns(self) -> list[str]:
        """The table's columns at this version, partition keys left out (no row is read)."""
        schema = _dataset(self.uri, self.run_id, self.iteration, self.version, self.storage_options).schema
        return [c for c in schema.names if c not in dataset_io.KEYS]


def stream_ids(part: Partition, batch_rows: int | None = None) -> np.ndarray:
    """The partition's rollout_ids in stream order (one column read)."""
    ids = [b["rollout_id"].to_numpy() for b in part.record_batches(["rollout_id"], batch_rows)]
    return np.concatenate(ids) if ids else np.zeros(0, np.int64)


def stream_places(ids: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each wanted id's place in `ids`, a table's key column in stream order; whether it is there at all)."""
    order = np.argsort(ids, kind="stable")
    loc = np.minimum(np.searchsorted(ids[order], wanted), max(len(ids) - 1, 0))
    found = ids[order][loc] == wanted if len(ids) else np.zeros(len(wanted), bool)
    return order[loc], found


class MergeTake:
    """Rows of a partition by their places in its stream, `positions` (one per output row, in output order):
    take(first, k) gives output rows first..first+k, called with increasing `first`. Increasing positions: a merge
    join, only the record batches from the first to the last row asked for are held; else the columns are taken
    whole into that order (`whole`: already taken by the caller, to share across passes)."""

    def __init__(
        self, part: Partition, columns: list[str], positions: np.ndarray, batch_rows: int | None, whole=None
    ) -> None:
        if whole is None and not bool((np.diff(positions) > 0).all()):
            whole = part.arrow(columns).take(pa.array(positions))
        self.positions, self.whole, self.held, self.start, self.end = positions, whole, [], 0, 0
        self.stream = part.record_batches(columns, batch_rows) if whole is None else None

    def take(self, first: int, k: int) -> pa.Table:
        if self.whole is not None:
            return self.whole.slice(first, k)
        places = self.positions[first : first + k]
        while self.end <= places[-1]:
            self.held.append(next(self.stream))
            self.end += self.held[-1].num_rows
        while self.start + self.held[0].num_rows <= places[0]:
            self.start += self.held.pop(0).num_rows
        return pa.Table.from_batches(self.held).take(pa.array(places - self.start))


def read_columns(
    uri: str,
    run_id: str,
    iteration: int,
    columns: list[str],
    *,
    version: int | None = None,
    storage_options: Options = None,
) -> pd.DataFrame:
    """A few columns of the partition (e.g. a written stage output's reward for the asset's metadata): the
    Parquet projection reads only those columns' pages."""
    return _dataset(uri, run_id, iteration, version, storage_options).to_table(columns=columns).to_pandas()


def write_frames(
    frames: Iterable[pd.DataFrame],
    target: str,
    name: str,
    *,
    run_id: str,
    iteration: int,
    lineage: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    storage_options: Options = None,
) -> int:
    """Replace partition (run_id, iteration) of table `name` at `target` with the rows of `frames` (consumed one
    at a time, one Parquet file each, in order: the table's row order is theirs): ONE Delta commit with `lineage`
    (or a function giving it, called once the files are written). Returns the new table version."""
    files = []
    for out in frames:
        if len(out):
            files.append(
                dataset_io.write_block(
                    out,
                    uri=uris.target(target),
                    options=uris.options_of(target, storage_options),
                    name=name,
                    run_id=run_id,
                    iteration=iteration,
                )
            )
    if not files:
        raise store.empty_partition_error(name, run_id, iteration)
    listing = pd.concat(files, ignore_index=True)
    return dataset_io.commit_files(
        target, name, listing, run_id=run_id, iteration=iteration, lineage=lineage, storage_options=storage_options
    )


def _run_local(
    fn: BatchFn, source: str, target: str, name: str, *, run_id, iteration, version, lineage, opts, columns
) -> int:
    """In-process: stream batches through `fn`, one Parquet file per output batch, ONE commit."""
    batches = iter_partition_batches(
        source, run_id, iteration, version=version, columns=columns, storage_options=opts, fill_missing=False
    )
    frames = (fn(batch) for batch in batches)
    return write_frames(frames, target, name, run_id=run_id, iteration=iteration, lineage=lineage, storage_options=opts)


def cpu_nodes() -> int:
    """Alive Ray nodes that have CPUs (a cluster's head started with num_cpus=0 does not count); 1 without Ray."""
    if not ray.is_initialized():
        return 1
    return max(1, sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0))


def ray_blocks(rows: int) -> int:
    """Blocks a Ray Data stage cuts `rows` into: at least one per CPU node, at most BATCH_ROWS rows each, never
    an empty one."""
    return max(1, min(rows, max(cpu_nodes(), -(-rows // BATCH_ROWS))))


def _run_ray(
    fn: BatchFn, source: str, target: str, name: str, *, run_id, iteration, version, lineage, opts, columns, rows: int
) -> int:
    """Ray Data: read tasks, map_batches(fn) and write tasks on the workers; one commit here. The rows are cut into
    at least one block per CPU node and blocks of at most BATCH_ROWS rows (ray_blocks). When the partition's
    files are already such blocks (ranks that wrote one file each), each file is one block and read, `fn` and the
    write fuse into one task per file; else (a driver-written partition is one file) the read is repartitioned
    first. Tasks with small arguments are spread over the nodes (Ray Data's default scheduling strategy, SPREAD),
    so every node with CPUs scores a part (the commit records the writing nodes)."""
    actions = dataset_io.partition_actions(source, run_id, iteration, version=version, storage_options=opts)
    ds = dataset_io.read_partition_dataset(
        source, run_id, iteration, version=version, columns=columns, storage_options=opts, files=actions["path"]
    )
    blocks, counts = ray_blocks(rows), actions.get("num_records", [])
    if not (len(counts) >= blocks and all(c is not None and 0 < c <= BATCH_ROWS for c in counts)):
        ds = ds.repartition(blocks)
    ds = ds.map_batches(
        lambda df: fn(df.drop(columns=[c for c in dataset_io.KEYS if c in df.columns])),
        batch_format="pandas",
        batch_size=None,
    )
    return dataset_io.write_partition_dataset(
        ds, target, name, run_id=run_id, iteration=iteration, lineage=lineage, storage_options=opts
    )


def run_table_stage(
    fn: BatchFn,
    source_uri: str,
    target_uri: str,
    name: str,
    *,
    run_id: str,
    iteration: int,
    version: int | None,
    lineage: Lineage,
    data_min_rows: int | None = None,
    storage_options: Options = None,
    columns: list[str] | None = None,
) -> StageRun:
    """Apply `fn` (a picklable pandas batch callable: rows in, rows out, no cross-row state) to partition
    (run_id, iteration) of the table at `source_uri` as of `version`, and replace that partition of table `name`
    at `target_uri` with its output: ONE commit with `lineage`. Ray Data from `data_min_rows` rows on.
    `columns`: read only these columns of the partition (None: all), in either mode; `fn` gets the batches a read
    of all columns gives, in the same rows and order, less the other columns (a column a file lacks stays out
    of its rows, as without `columns`), so the other columns' pages are never read."""
    t0 = time.perf_counter()
    meta = (lambda: lineage(time.perf_counter() - t0)) if callable(lineage) else lineage
    rows = partition_rows(source_uri, run_id, iteration, version=version, storage_options=storage_options)
    if not rows:
        raise store.missing_partition_error(source_uri, version, run_id, iteration)
    mode = choose_mode(rows, data_min_rows)
    run = functools.partial(_run_ray, rows=rows) if mode == "ray" else _run_local
    v = run(
        fn,
        source_uri,
        target_uri,
        name,
        run_id=run_id,
        iteration=iteration,
        version=version,
        lineage=meta,
        opts=storage_options,
        columns=columns,
    )
    return StageRun(version=v, rows=rows, mode=mode)
