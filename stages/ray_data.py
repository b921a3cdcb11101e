"""Running a stage callable over a DataFrame on a Ray Data actor pool (one engine per actor)."""
from __future__ import annotations

import pandas as pd


def actor_cpus(workers: int, want: float = 1.0) -> float:
    """CPUs per Ray Data actor so that `workers` actors leave one CPU for Ray Data's own tasks
    (actors holding every CPU deadlock the tasks feeding them: seen on 2 cores)."""
    import ray

    total = float(ray.cluster_resources().get("CPU", 1.0))
    return max(0.1, min(want, (total - 1.0) / workers))


def split_frame(df: pd.DataFrame, parts: int) -> list[pd.DataFrame]:
    """Contiguous, near-equal chunks: Ray Data blocks made in the driver, no repartition task."""
    bounds = [round(i * len(df) / parts) for i in range(parts + 1)]
    return [df.iloc[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def map_with_actor_pool(df: pd.DataFrame, stage_cls: type, kwargs: dict, *, workers: int,
                        cpus_per_actor: float = 1.0) -> pd.DataFrame:
    """`stage_cls(**kwargs)` built once per actor, called on one contiguous block per actor."""
    import ray.data

    ds = ray.data.from_pandas(split_frame(df, workers))
    return ds.map_batches(stage_cls, fn_constructor_kwargs=kwargs, batch_format="pandas", batch_size=None,
                          compute=ray.data.ActorPoolStrategy(size=workers),
                          num_cpus=actor_cpus(workers, cpus_per_actor)).to_pandas()
