"""Shared pieces of the assets: partitions, groups, lineage metadata."""
from __future__ import annotations

import time
from contextlib import contextmanager

import dagster as dg

iterations = dg.DynamicPartitionsDefinition(name="iteration")

DATA = "DATA"
ROLLOUT = "ROLLOUT"
TRAIN = "TRAIN"
EVAL = "EVAL"


def lineage(cfg, *, stage: str, policy_version: int | None, upstream: dict[str, int | None],
            duration_s: float) -> dict:
    """Commit metadata every table write carries (run id, iteration and code version are added by the store)."""
    return {"stage": stage, "policy_version": str(policy_version), "config_hash": cfg.config_hash(),
            "upstream": upstream, "duration_s": f"{duration_s:.3f}"}


@contextmanager
def timed():
    box = {"s": 0.0}
    t0 = time.perf_counter()
    try:
        yield box
    finally:
        box["s"] = time.perf_counter() - t0
