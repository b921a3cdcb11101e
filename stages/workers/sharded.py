"""A table over one worker group: contiguous shards, one per rank, the ranks' outputs in rank order.

Every stage that holds a model over rows (rollouts, ref / teacher log-probs, old log-probs, values, reward-model
scores, judge verdicts) runs through `sharded_run`; the group comes from `make_group`, a WorkerGroup of Ray actors
(stages/workers/group.py) or, with use_ray=False (unit tests), a `LocalGroup`: the same interface over one worker
object in this process. So each stage has one code path; only the group and the source differ:

- a Partition handle (stages/io/stage_exec.py): each rank reads its own slice of the Delta partition at the
  recorded version and writes its output through a Sink; the caller commits the files once (`commit_shards`).
  The rows never pass through the caller (the Dagster step): it sends a few numbers per rank and gets back a
  file record and a summary;
- a DataFrame (`sharded_call`): its shards are sent to the ranks and their outputs come back concatenated.

    group = lambda: worker_group(RefWorker, "ref", 2, **kw) if use_ray else local_group(RefWorker, 1, **kw)
    out = sharded_call(group, RefWorker.compute_ref_log_prob, rollouts, lambda shard: (shard,), retries=3)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pandas as pd

from stages.io import dataset_io, store
from stages.io.stage_exec import Lineage, Partition, partition_rows
from stages.workers.group import Worker, WorkerGroup, _method_name, call_with_retry
from stages.workers.shard_io import SHARD, Finish, Prepare, Rows, ShardMarker, ShardResult, Sink, Slice
from stages.workers.tasks import split_bounds

R = TypeVar("R")


class LocalGroup:
    """The WorkerGroup interface (`call`, `call_each`, `kill`, `num_workers`, `role`) over worker objects in this
    process: rank i is workers[i], called by bound method in rank order. Owned by the one call it was made for:
    `sharded_call` kills it afterwards, which closes each worker that has a `close` (an engine's memory)."""

    def __init__(self, worker_cls: type, role: str, workers: list) -> None:
        self.worker_cls, self.role, self.workers = worker_cls, role, workers

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def call(self, method: Callable[..., R], *args: Any) -> list[R]:
        """method(*args) on every rank; results in rank order."""
        return self.call_each(method, [args] * self.num_workers)

    def call_each(self, method: Callable[..., R], per_rank_args: Sequence[tuple]) -> list[R]:
        """method(*per_rank_args[i]) on rank i (fewer argument tuples than ranks: the first ranks only)."""
        _method_name(self.worker_cls, method)  # a method of another class fails here, as in a WorkerGroup
        return [method(w, *a) for w, a in zip(self.workers, per_rank_args, strict=False)]

    def kill(self) -> None:
        for w in self.workers:
            close = getattr(w, "close", None)
            if close is not None:
                close()
        self.workers = []


def local_group(worker_cls: type, threads: int, *, role: str = "local", **init_kwargs: Any) -> LocalGroup:
    """A LocalGroup of one worker_cls(rank 0, world 1, threads, **init_kwargs) in this process (use_ray=False)."""
    return LocalGroup(worker_cls, role, [worker_cls(0, 1, threads, **init_kwargs)])


def _bounds(rows: int, ranks: int, every_rank: bool) -> list[tuple[int, int]]:
    """[start, stop) of each called rank's contiguous rows, as split_frame cuts a frame of `rows` rows:
    min(ranks, rows) non-empty spans, then (every_rank) empty ones up to `ranks`."""
    spans = split_bounds(rows, min(ranks, rows))
    return spans + [(rows, rows)] * (ranks - len(spans)) if every_rank else spans


def source_rows(source: pd.DataFrame | Partition) -> int:
    """Rows of a frame, or of a partition at its version (from the Delta log's file stats: no row read)."""
    if isinstance(source, pd.DataFrame):
        return len(source)
    return partition_rows(source.uri, source.run_id, source.iteration, version=source.version)


def _sources(source: pd.DataFrame | Partition, columns: tuple[str, ...] | None, ranks: int, every_rank: bool) -> list:
    """One source per called rank: Rows of a frame's contiguous shards, or Slices of a partition (read there);
    `columns` (None: all) those of them the frame or table has."""
    if isinstance(source, pd.DataFrame):  # projected to `columns` as a Slice reads them
        frame = source if columns is None else source[[c for c in columns if c in source.columns]]
        return [Rows(frame.iloc[a:b]) for a, b in _bounds(len(frame), ranks, every_rank)]
    rows = source_rows(source)
    version = None if source.version is None else int(source.version)  # a plain int crosses to the ranks
    return [
        Slice(source.uri, source.run_id, source.iteration, version, columns, a, b)
        for a, b in _bounds(rows, ranks, every_rank)
    ]


def sharded_run(
    make_group: Callable[[], WorkerGroup | LocalGroup],
    method: Callable[..., pd.DataFrame],
    source: pd.DataFrame | Partition,
    args_of_shard: Callable[[ShardMarker], tuple],
    *,
    columns: tuple[str, ...] | None = None,
    sink: Sink | None = None,
    finish: Finish | None = None,
    prepare: Prepare | None = None,
    every_rank: bool = False,
    retries: int = 1,
) -> list[ShardResult]:
    """method(*args_of_shard(SHARD)) on the group's ranks, rank i on the i-th contiguous shard of `source`: a
    frame's rows sent along, or (a Partition handle) rows [start, stop) of the partition at its version, which
    the rank reads itself (`columns` of it; None: all). With a `sink` each rank writes its output as one Parquet
    file of the sink's partition (commit them with commit_shards); `prepare` and `finish` pre- and post-process
    on the rank. One ShardResult per called rank, in rank order.

    Shards: min(ranks, rows) non-empty ones, the first ranks only; every_rank: one per rank, the last ones empty
    when rows are fewer than ranks (e.g. the trainer ranks must all take part). An actor that died: the group is
    rebuilt and the call retried up to `retries` times (call_with_retry; a failed attempt's files are orphans no
    commit names); a LocalGroup is killed after its call, whatever the outcome."""
    name = method.__name__

    def run(group: WorkerGroup | LocalGroup) -> list[ShardResult]:
        _method_name(group.worker_cls, method)  # a typo fails here, not on the rank
        shards = _sources(source, columns, group.num_workers, every_rank)
        per_rank = [(name, args_of_shard(SHARD), shard, sink, finish, prepare) for shard in shards]
        try:
            return group.call_each(Worker.run_shard, per_rank)
        finally:
            if isinstance(group, LocalGroup):
                group.kill()

    return call_with_retry(make_group, run, retries=retries)


def sharded_call(
    make_group: Callable[[], WorkerGroup | LocalGroup],
    method: Callable[..., pd.DataFrame],
    frame: pd.DataFrame,
    args_of_shard: Callable[[ShardMarker], tuple],
    *,
    every_rank: bool = False,
    retries: int = 1,
) -> pd.DataFrame:
    """sharded_run over a frame's rows, the ranks' outputs concatenated in rank order (index reset)."""
    return shard_frames(sharded_run(make_group, method, frame, args_of_shard, every_rank=every_rank, retries=retries))


def shard_frames(results: list[ShardResult]) -> pd.DataFrame:
    """The rows the ranks sent back (a sharded_run without a sink), concatenated in rank order (index reset)."""
    return pd.concat([r.frame for r in results], ignore_index=True)


def commit_shards(sink: Sink, results: list[ShardResult], lineage: Lineage) -> int:
    """ONE Delta commit of the files the ranks wrote through `sink` (sharded_run), in rank order, replacing the
    sink's partition with rlake's lineage (or a function giving it, called now); returns the new table version.
    No rank wrote a row: the partition-empty error, nothing committed."""
    files = [r.files for r in results if r.files is not None and len(r.files)]
    if not files:
        raise store.empty_partition_error(sink.name, sink.run_id, sink.iteration)
    listing = pd.concat(files, ignore_index=True)
    return dataset_io.commit_files(
        sink.uri,
        sink.name,
        listing,
        run_id=sink.run_id,
        iteration=sink.iteration,
        lineage=lineage,
        storage_options=None,
    )
