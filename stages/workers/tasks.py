"""Running a stage over a DataFrame on Ray: stateless callables as Ray tasks, stateful stage classes
(holding a model) in persistent stage hosts, one contiguous block per worker."""
from __future__ import annotations

from functools import lru_cache

import pandas as pd


def split_frame(df: pd.DataFrame, parts: int) -> list[pd.DataFrame]:
    """Contiguous, near-equal chunks made in the driver, one per task or host (no repartition step)."""
    bounds = [round(i * len(df) / parts) for i in range(parts + 1)]
    return [df.iloc[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


MAX_ACTOR_RESTARTS = 3
"""A stage worker that dies (OOM kill, segfault, os._exit) is replaced and its blocks retried up to
this many times; then the run fails with the worker's error instead of hanging."""


def _call(fn, block: pd.DataFrame) -> pd.DataFrame:
    return fn(block)


@lru_cache(maxsize=1)
def _remote_call():
    """The task, defined once per process so Ray exports it once. A worker that dies is replaced and
    its block re-run up to MAX_ACTOR_RESTARTS times, RaySystemError included (as Ray Data's tasks do);
    an exception the stage raises is not retried. Ray Data's map_batches has no named option for a
    retry limit (only the deprecated **ray_remote_args, removed in Ray 2.64; its default is unbounded)."""
    import ray

    return ray.remote(max_retries=MAX_ACTOR_RESTARTS, retry_exceptions=[ray.exceptions.RaySystemError],
                      scheduling_strategy="DEFAULT")(_call)


def map_with_tasks(df: pd.DataFrame, fn, *, parts: int, num_cpus: float = 1.0) -> pd.DataFrame:
    """A stateless callable over `parts` contiguous blocks as Ray tasks; the output keeps block order.

    Tasks run in Ray's pooled worker processes, which stay warm between calls (a fresh actor pool
    per call cost seconds per iteration: imports and process start-up)."""
    import ray

    blocks = split_frame(df, parts)
    if not blocks:
        return fn(df)
    task, fn_ref = _remote_call().options(num_cpus=num_cpus), ray.put(fn)
    return pd.concat(ray.get([task.remote(fn_ref, block) for block in blocks]), ignore_index=True)


_INSTANCES: dict[str, tuple[str, object]] = {}
"""In a stage host: class qualname -> (constructor kwargs key, instance); the newest per class."""


def host_call(qualname: str, kwargs: dict, block: pd.DataFrame) -> pd.DataFrame:
    """Call this host's `qualname(**kwargs)` instance on a block (constructed on first use)."""
    from stages.workers.group import resolve

    key = repr(sorted(kwargs.items()))
    cached = _INSTANCES.get(qualname)
    if cached is None or cached[0] != key:
        _INSTANCES.pop(qualname, None)  # drop the old instance (and its model) before building
        _INSTANCES[qualname] = (key, resolve(qualname)(**kwargs))
    return _INSTANCES[qualname][1](block)


def map_with_actor_pool(df: pd.DataFrame, stage_cls: type, kwargs: dict, *, workers: int,
                        cpus_per_actor: float = 1.0) -> pd.DataFrame:
    """`stage_cls(**kwargs)` on one contiguous block per worker, in persistent stage hosts.

    The hosts (a stages.workers.group group per stage class) live for the whole run and keep the
    instance while the kwargs stay the same, so a stage holding a model (reference policy) loads it
    once per run, not once per iteration. A killed host is replaced and its block re-run (up to
    MAX_ACTOR_RESTARTS times); the output holds each input block exactly once."""
    from stages.workers.group import run_with_retry

    qualname = f"{stage_cls.__module__}:{stage_cls.__qualname__}"
    threads = max(1, round(cpus_per_actor))
    calls = [(f"{__name__}:host_call", qualname, kwargs, block) for block in split_frame(df, workers)]
    parts = run_with_retry(f"stage:{qualname}", workers, lambda g: g.map("call", calls), threads=threads,
                           process_group=False, retries=MAX_ACTOR_RESTARTS)
    return pd.concat(parts, ignore_index=True)
