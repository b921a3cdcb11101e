"""Stateless work over a DataFrame as Ray tasks (the reward stage), one contiguous block per task.

Stages that hold a model (rollout engine, reference policy, trainer, critic) use a worker group
(stages/workers/group.py) instead; `split_frame` cuts their batches into per-rank shards too.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import pandas as pd
import ray

MAX_ACTOR_RESTARTS = 3
"""A task or worker that dies (OOM kill, segfault, os._exit) is replaced and its block retried up to
this many times; then the run fails with the worker's error instead of hanging."""


def split_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` contiguous, near-equal chunks of `rows` rows, the empty ones left out."""
    cuts = [round(i * rows / parts) for i in range(parts + 1)] if parts > 0 else [0]
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def split_frame(df: pd.DataFrame, parts: int) -> list[pd.DataFrame]:
    """Contiguous, near-equal chunks made in the driver, one per task or worker (no repartition step)."""
    return [df.iloc[a:b] for a, b in split_bounds(len(df), parts)]


def _call(fn: Callable[[pd.DataFrame], pd.DataFrame], block: pd.DataFrame) -> pd.DataFrame:
    return fn(block)


@lru_cache(maxsize=1)
def _remote_call():
    """The task, defined once per process so Ray exports it once. A worker that dies is replaced and
    its block re-run up to MAX_ACTOR_RESTARTS times, RaySystemError included; an exception the stage
    raises is not retried."""
    return ray.remote(
        max_retries=MAX_ACTOR_RESTARTS, retry_exceptions=[ray.exceptions.RaySystemError], scheduling_strategy="DEFAULT"
    )(_call)


def map_with_tasks(
    df: pd.DataFrame, fn: Callable[[pd.DataFrame], pd.DataFrame], *, parts: int, num_cpus: float = 1.0
) -> pd.DataFrame:
    """A stateless callable over `parts` contiguous blocks as Ray tasks; the output keeps block order.

    Tasks run in Ray's pooled worker processes, which stay warm between calls (a fresh actor pool
    per call cost seconds per iteration: imports and process start-up)."""
    blocks = split_frame(df, parts)
    if not blocks:
        return fn(df)
    task, fn_ref = _remote_call().options(num_cpus=num_cpus), ray.put(fn)
    return pd.concat(ray.get([task.remote(fn_ref, block) for block in blocks]), ignore_index=True)
