"""What one rank of a worker group reads and writes in a sharded stage: its rows in, its output out.

A stage that runs a model over a table (old / ref / teacher log-probs, values) hands each rank a *source* and,
when it writes a table, a *sink*; `Worker.run_shard` (stages/workers/group.py) reads the source, calls the
worker's method on the rows, and writes its output through the sink itself. The caller (the Dagster step)
gets one small `ShardResult` per rank: the written file's record and a summary, never the rows. It makes ONE
Delta commit of every rank's file (stages/workers/sharded.py `commit_shards`), so a failed rank leaves at most
an orphan file no commit names, never a half-written partition.

Sources:
- `Slice`: rows [start, stop) of a Delta partition at a recorded version, in table order, read by the rank
  (its keys first, one column, then only its rows and only the columns it needs);
- `Rows`: rows the caller already holds (unit tests, a stage whose input is small: prompts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pyarrow.compute as pc

from stages.io import dataset_io, uris
from stages.io.dataset_io import KEYS
from stages.io.store import present_columns, read_partition


class ShardMarker:
    """Where a method's arguments take the rank's rows: `args_of_shard(SHARD)` in sharded.py, replaced on the
    rank by what its source read. Compared by type, so it survives pickling."""

    def __repr__(self) -> str:
        return "SHARD"


SHARD = ShardMarker()


@dataclass(frozen=True)
class Rows:
    """Rows the caller holds, shipped to the rank with the call."""

    frame: pd.DataFrame

    def read(self) -> pd.DataFrame:
        return self.frame


@dataclass(frozen=True)
class Slice:
    """Rows [start, stop) of partition (run_id, iteration) of the table at `uri` (a StorageURI carries its
    options) as of `version`, in table order; `columns` those of them the table has (None: every column but the
    partition keys); `key` a unique column."""

    uri: str
    run_id: str
    iteration: int
    version: int | None
    columns: tuple[str, ...] | None
    start: int
    stop: int
    key: str = "rollout_id"

    def read(self) -> pd.DataFrame:
        """The slice's rows: the partition's keys (one column) first, then only these rows (a pyarrow filter on
        the key) and only `columns`: a rank never reads the whole partition. An empty slice reads no rows but
        keeps the table's column types (a rank with nothing to do still gets typed columns)."""
        wanted = [c for c in present_columns(self.uri, self.columns, version=self.version) if c not in KEYS]
        part = (self.uri, self.run_id, self.iteration)
        mine = []
        if self.stop > self.start:
            keys = read_partition(*part, version=self.version, columns=[self.key])[self.key].to_numpy()
            mine = keys[self.start : self.stop]
        rows = read_partition(*part, version=self.version, columns=wanted, filters=pc.field(self.key).isin(mine))
        if len(rows) != self.stop - self.start:
            raise LookupError(
                f"rows {self.start}:{self.stop} of '{uris.name(self.uri)}' run {self.run_id} iteration "
                f"{self.iteration} (version {self.version}) read back as {len(rows)} rows: '{self.key}' is not "
                "unique in the partition, so a rank cannot tell its rows apart"
            )
        return rows.reset_index(drop=True)


@dataclass(frozen=True)
class Sink:
    """Where a rank writes its output: one Parquet file in partition (run_id, iteration) of table `name` at
    `uri`, cast to the table's schema (stages/io/tables.py); the caller commits the files."""

    uri: str
    name: str
    run_id: str
    iteration: int

    def write(self, df: pd.DataFrame) -> pd.DataFrame:
        """The written file's record (one row: path, size, rows, stats, schema, sets); no rows: no file."""
        if not len(df):
            return pd.DataFrame()
        return dataset_io.write_block(
            df,
            uri=uris.target(self.uri),
            options=uris.options_of(self.uri),
            name=self.name,
            run_id=self.run_id,
            iteration=self.iteration,
        )


Finish = Callable[[pd.DataFrame, pd.DataFrame], tuple[pd.DataFrame, Any]]
"""finish(rows the rank read, the method's output) -> (the output to keep, a small summary for the caller):
per-row columns computed on the rank (e.g. the engine-vs-trainer gap) and what the caller's metadata needs."""


@dataclass
class ShardResult:
    """What one rank sends back: its output rows (no sink) or its file record (a sink), and `finish`'s summary."""

    rows: int
    frame: pd.DataFrame | None
    files: pd.DataFrame | None
    summary: Any = None


Prepare = Callable[[pd.DataFrame], pd.DataFrame]
"""prepare(rows the rank read) -> what the method takes in place of SHARD (e.g. the judge's prompts built from the
rollouts); `finish` then gets the prepared rows."""


def run_shard(
    worker, method: str, args: tuple, source, sink: Sink | None, finish: Finish | None, prepare: Prepare | None = None
) -> ShardResult:
    """On the rank: read `source` (and `prepare` the rows), call worker.<method>(*args) with them in place of
    SHARD, `finish`, then write through `sink` (or send the rows back)."""
    frame = source.read()
    frame = prepare(frame) if prepare is not None else frame
    out = getattr(worker, method)(*[frame if isinstance(a, ShardMarker) else a for a in args])
    out, summary = finish(frame, out) if finish is not None else (out, None)
    if sink is None:
        return ShardResult(len(out), out, None, summary)
    return ShardResult(len(out), None, sink.write(out), summary)
