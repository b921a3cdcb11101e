"""Running a stage over a DataFrame on Ray: stateless callables as Ray Data tasks, stateful stage
classes (holding a model) in persistent stage hosts, one contiguous block per worker."""
from __future__ import annotations

import pandas as pd


def split_frame(df: pd.DataFrame, parts: int) -> list[pd.DataFrame]:
    """Contiguous, near-equal chunks: Ray Data blocks made in the driver, no repartition task."""
    bounds = [round(i * len(df) / parts) for i in range(parts + 1)]
    return [df.iloc[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


MAX_ACTOR_RESTARTS = 3
"""A stage worker that dies (OOM kill, segfault, os._exit) is replaced and its blocks retried up to
this many times; then the run fails with the worker's error instead of hanging."""


def map_with_tasks(df: pd.DataFrame, fn, *, parts: int, num_cpus: float = 1.0) -> pd.DataFrame:
    """A stateless callable over `parts` contiguous blocks as Ray Data tasks.

    Tasks run in Ray's pooled worker processes, which stay warm between calls (a fresh actor pool
    per call cost seconds per iteration: imports and process start-up)."""
    import ray.data

    ds = ray.data.from_pandas(split_frame(df, parts))
    return ds.map_batches(fn, batch_format="pandas", batch_size=None, num_cpus=num_cpus,
                          max_retries=MAX_ACTOR_RESTARTS).to_pandas()


_INSTANCES: dict[str, tuple[str, object]] = {}
"""In a stage host: class qualname -> (constructor kwargs key, instance); the newest per class."""


def host_call(qualname: str, kwargs: dict, block: pd.DataFrame) -> pd.DataFrame:
    """Call this host's `qualname(**kwargs)` instance on a block (constructed on first use)."""
    from stages.worker_group import resolve

    key = repr(sorted(kwargs.items()))
    cached = _INSTANCES.get(qualname)
    if cached is None or cached[0] != key:
        _INSTANCES.pop(qualname, None)  # drop the old instance (and its model) before building
        _INSTANCES[qualname] = (key, resolve(qualname)(**kwargs))
    return _INSTANCES[qualname][1](block)


def map_with_actor_pool(df: pd.DataFrame, stage_cls: type, kwargs: dict, *, workers: int,
                        cpus_per_actor: float = 1.0) -> pd.DataFrame:
    """`stage_cls(**kwargs)` on one contiguous block per worker, in persistent stage hosts.

    The hosts (a stages.worker_group group per stage class) live for the whole run and keep the
    instance while the kwargs stay the same, so a stage holding a model (reference policy) loads it
    once per run, not once per iteration. A killed host is replaced and its block re-run (up to
    MAX_ACTOR_RESTARTS times); the output holds each input block exactly once."""
    from stages.worker_group import run_with_retry

    qualname = f"{stage_cls.__module__}:{stage_cls.__qualname__}"
    threads = max(1, round(cpus_per_actor))
    calls = [(f"{__name__}:host_call", qualname, kwargs, block) for block in split_frame(df, workers)]
    parts = run_with_retry(f"stage:{qualname}", workers, lambda g: g.map("call", calls), threads=threads,
                           process_group=False, retries=MAX_ACTOR_RESTARTS)
    return pd.concat(parts, ignore_index=True)
