"""map_with_tasks on a real local Ray: block order kept, a dead worker's block re-run, a bounded number of
retries, no Ray deprecation warning."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pandas as pd
import pytest

from stages.workers.tasks import MAX_ACTOR_RESTARTS, map_with_tasks

pytestmark = pytest.mark.ray


def _attempts(tmp_path: Path, fail: str):
    """A stage that records each attempt as a file, then dies (os._exit) or raises as `fail` says."""

    def stage(batch: pd.DataFrame) -> pd.DataFrame:
        n = len(list(tmp_path.iterdir()))
        (tmp_path / f"attempt_{n}_{os.getpid()}").touch()
        if fail == "always" or (fail == "once" and n == 0):
            os._exit(1)
        if fail == "raise":
            raise ValueError("bad row")
        return batch.assign(y=batch["x"] * 2)

    return stage


def test_blocks_in_order_and_no_deprecation_warning(ray_session, tmp_path) -> None:
    from ray.util.annotations import RayDeprecationWarning

    df = pd.DataFrame({"x": range(7)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RayDeprecationWarning)  # map_batches(max_retries=...) raised here
        out = map_with_tasks(df, _attempts(tmp_path, "never"), parts=3, num_cpus=0.5)
    assert out["x"].tolist() == list(range(7)) and (out["y"] == out["x"] * 2).all()
    assert len(list(tmp_path.iterdir())) == 3  # one task per block


def test_dead_worker_block_is_rerun(ray_session, tmp_path) -> None:
    out = map_with_tasks(pd.DataFrame({"x": range(4)}), _attempts(tmp_path, "once"), parts=1, num_cpus=0.5)
    assert out["y"].tolist() == [0, 2, 4, 6]
    assert len(list(tmp_path.iterdir())) == 2  # died, then re-run on a new worker


def test_worker_that_always_dies_fails_after_the_retries(ray_session, tmp_path) -> None:
    import ray

    with pytest.raises(ray.exceptions.RayError):
        map_with_tasks(pd.DataFrame({"x": range(2)}), _attempts(tmp_path, "always"), parts=1, num_cpus=0.5)
    assert len(list(tmp_path.iterdir())) == MAX_ACTOR_RESTARTS + 1


def test_stage_exception_is_not_retried(ray_session, tmp_path) -> None:
    with pytest.raises(ValueError, match="bad row"):
        map_with_tasks(pd.DataFrame({"x": range(2)}), _attempts(tmp_path, "raise"), parts=1, num_cpus=0.5)
    assert len(list(tmp_path.iterdir())) == 1
