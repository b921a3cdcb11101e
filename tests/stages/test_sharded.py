"""sharded_call, the one shard-and-call path of the model stages: contiguous shards in rank order, on a LocalGroup
(use_ray=False, this process) and on a real Ray WorkerGroup, with the same rows either way; a LocalGroup's
workers are closed after the call, errors and all."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from stages.workers.group import Worker
from stages.workers.sharded import LocalGroup, local_group, shard_frames, sharded_call, sharded_run


class Tagger(Worker):
    """Tags each row with the rank that saw it; module level so Ray workers import it by name."""

    def __init__(self, rank: int, world: int, threads: int, shape: str = "", *, scale: float = 1.0) -> None:
        super().__init__(rank, world, threads, shape)
        self.scale, self.closed = scale, False

    def tag(self, shard: pd.DataFrame, offset: float) -> pd.DataFrame:
        if (shard["x"] < 0).any():
            raise ValueError("negative x")
        return shard.assign(y=shard["x"] * self.scale + offset, rank=self.rank, pid=os.getpid())

    def close(self) -> None:
        self.closed = True


def _frame(n: int) -> pd.DataFrame:
    return pd.DataFrame({"x": range(n)}, index=range(100, 100 + n))  # a non-default index: the output resets it


def _local(workers: int) -> LocalGroup:
    return LocalGroup(Tagger, "tagger", [Tagger(r, workers, 1) for r in range(workers)])


def test_local_group_runs_the_whole_frame_in_this_process() -> None:
    out = sharded_call(lambda: local_group(Tagger, 1, scale=2.0), Tagger.tag, _frame(5), lambda s: (s, 0.5))
    assert out["y"].tolist() == [0.5, 2.5, 4.5, 6.5, 8.5] and set(out["pid"]) == {os.getpid()}
    assert out.index.tolist() == list(range(5))


def test_shards_are_contiguous_in_rank_order() -> None:
    out = sharded_call(lambda: _local(3), Tagger.tag, _frame(7), lambda s: (s, 0.0))
    assert out["x"].tolist() == list(range(7))
    assert out["rank"].tolist() == [0, 0, 1, 1, 1, 2, 2]  # split_frame's bounds 0, 2, 5, 7


def test_fewer_rows_than_ranks() -> None:
    """Default: only the first ranks are called; every_rank: the others get an empty shard, the last ones."""
    results = sharded_run(lambda: _local(3), Tagger.tag, _frame(2), lambda shard: (shard, 0.0))
    assert [r.rows for r in results] == [1, 1] and shard_frames(results)["rank"].tolist() == [0, 1]
    results = sharded_run(lambda: _local(3), Tagger.tag, _frame(2), lambda shard: (shard, 0.0), every_rank=True)
    assert [r.rows for r in results] == [1, 1, 0] and shard_frames(results)["rank"].tolist() == [0, 1]
    results = sharded_run(lambda: _local(4), Tagger.tag, _frame(2), lambda shard: (shard, 0.0), every_rank=True)
    assert [r.rows for r in results] == [1, 1, 0, 0]


def test_local_workers_are_closed_after_the_call_and_after_an_error() -> None:
    groups: list[LocalGroup] = []

    def make() -> LocalGroup:
        groups.append(_local(2))
        return groups[-1]

    sharded_call(make, Tagger.tag, _frame(4), lambda s: (s, 0.0))
    bad = pd.DataFrame({"x": [1, -1]})
    with pytest.raises(ValueError, match="negative x"):  # a Python error is not retried: one group built
        sharded_call(make, Tagger.tag, bad, lambda s: (s, 0.0), retries=3)
    assert len(groups) == 2 and all(g.workers == [] for g in groups)


class Other:
    def tag(self, shard: pd.DataFrame, offset: float) -> pd.DataFrame:
        return shard


def test_a_method_of_another_class_is_refused() -> None:
    """As WorkerGroup.call_each: a method of another class fails before any rank runs it."""
    with pytest.raises(TypeError, match=r"is not a method of Tagger; call the group with one, e.g. Tagger.tag"):
        sharded_call(lambda: _local(1), Other.tag, _frame(2), lambda s: (s, 0.0))


@pytest.mark.ray
def test_ray_group_gives_the_local_rows(ray_session) -> None:
    from stages.workers.group import worker_group

    frame = _frame(9)
    local = sharded_call(lambda: local_group(Tagger, 1, scale=3.0), Tagger.tag, frame, lambda s: (s, 1.0))
    group = worker_group(Tagger, "sharded-test", 2, scale=3.0)
    try:
        remote = sharded_call(lambda: group, Tagger.tag, frame, lambda s: (s, 1.0))
    finally:
        group.kill()
    assert remote["rank"].tolist() == [0] * 4 + [1] * 5  # contiguous, in rank order
    assert remote["pid"].nunique() == 2 and os.getpid() not in set(remote["pid"])
    pd.testing.assert_frame_equal(remote.drop(columns=["rank", "pid"]), local.drop(columns=["rank", "pid"]))


@pytest.mark.ray
def test_judge_on_a_local_group_equals_the_judge_group(ray_session, tiny_checkpoint) -> None:
    """A stage through sharded_call: judge_rollouts' verdicts in this process (LocalGroup) and on the run's one
    "judge" worker (greedy, the same single shard) are the same rows."""
    from configs.schema import load_config
    from stages.judgements import judge_rollouts
    from stages.workers.group import shutdown_worker_groups

    cfg = load_config(
        "configs/ci_tiny.yaml",
        ["reward.judge.enable=true", f"reward.judge.model_path={tiny_checkpoint}", "reward.judge.max_tokens=4"],
    )
    rollouts = pd.DataFrame(
        {
            "rollout_id": [2, 0, 1],
            "prompt_id": [1, 0, 0],
            "prompt_text": ["1+1=", "2+2=", "2+2="],
            "response_text": ["2", "4", "5"],
            "ground_truth": ["2", "4", "4"],
        }
    )
    local = shard_frames(judge_rollouts(cfg, rollouts, None, 0, use_ray=False))
    try:
        remote = shard_frames(judge_rollouts(cfg, rollouts, None, 0))
    finally:
        shutdown_worker_groups()
    assert local["rollout_id"].tolist() == [0, 1, 2]
    pd.testing.assert_frame_equal(local, remote)
