"""One frame over one worker group: contiguous shards, one per rank, the ranks' outputs concatenated in rank order.

Every stage that holds a model over a DataFrame (rollouts, ref / teacher log-probs, old log-probs, reward-model
scores, judge verdicts) runs through `sharded_call`; the group comes from `make_group`, a WorkerGroup of Ray actors
(stages/workers/group.py) or, with use_ray=False (unit tests), a `LocalGroup`: the same interface over one worker
object in this process. So each stage has one code path; only the group differs.

    group = lambda: worker_group(RefWorker, "ref", 2, **kw) if use_ray else local_group(RefWorker, 1, **kw)
    out = sharded_call(group, RefWorker.compute_ref_log_prob, rollouts, lambda shard: (shard,), retries=3)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pandas as pd

from stages.workers.group import WorkerGroup, _method_name, call_with_retry
from stages.workers.tasks import split_frame

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


def rank_shards(rows: pd.DataFrame, ranks: int) -> list[pd.DataFrame]:
    """`ranks` contiguous shards of rows (split_frame), the last ones empty when rows are fewer than ranks."""
    shards = split_frame(rows, ranks)
    return shards + [rows.iloc[0:0]] * (ranks - len(shards))


def sharded_call(
    make_group: Callable[[], WorkerGroup | LocalGroup],
    method: Callable[..., pd.DataFrame],
    frame: pd.DataFrame,
    args_of_shard: Callable[[pd.DataFrame], tuple],
    *,
    every_rank: bool = False,
    retries: int = 1,
) -> pd.DataFrame:
    """method(*args_of_shard(shard)) on the group's ranks, rank i on the i-th contiguous shard of frame; the outputs
    concatenated in rank order (index reset).

    Shards: min(ranks, len(frame)) non-empty ones, the first ranks only (split_frame); every_rank: one per rank,
    the last ones empty when rows are fewer than ranks (rank_shards: e.g. the trainer ranks must all take part).
    An actor that died: the group is rebuilt and the call retried up to `retries` times (call_with_retry); a
    LocalGroup is killed after its call, whatever the outcome."""

    def run(group: WorkerGroup | LocalGroup) -> list[pd.DataFrame]:
        n = group.num_workers
        shards = rank_shards(frame, n) if every_rank else split_frame(frame, min(n, len(frame)))
        try:
            return group.call_each(method, [args_of_shard(shard) for shard in shards])
        finally:
            if isinstance(group, LocalGroup):
                group.kill()

    return pd.concat(call_with_retry(make_group, run, retries=retries), ignore_index=True)
