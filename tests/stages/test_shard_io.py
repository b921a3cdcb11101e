"""A worker group's stage from Delta to Delta (stages/workers/shard_io.py, sharded.py): each rank reads its own
contiguous slice of the partition at the recorded version and writes its output file; ONE commit by the caller,
rows in table order, and the caller never holds a row."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from stages.io import store
from stages.io.stage_exec import Partition, write_frames
from stages.workers.group import Worker
from stages.workers.shard_io import Sink, Slice
from stages.workers.sharded import LocalGroup, commit_shards, sharded_run

sys.path.insert(0, str(Path(__file__).parent))
from helpers_rollouts import make_rows


class Doubler(Worker):
    """A worker whose method doubles each response token id (and says which rank it ran on)."""

    def double(self, rows: pd.DataFrame, offset: int) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "rollout_id": rows["rollout_id"].to_numpy(),
                "policy_version": self.rank,
                "ref_policy_version": 0,
                "ref_logprobs": [[2.0 * t + offset for t in r] for r in rows["response_token_ids"]],
            }
        )


def count_tokens(rows: pd.DataFrame, out: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    return out, {"tokens": int(sum(len(r) for r in rows["response_token_ids"]))}


def _rollouts(tmp_path, n: int = 11) -> Partition:
    """n rollouts (ids 100 + 3i, not positions) in two Parquet files of one commit (an advantages-shaped table:
    a slice reads any table)."""
    frame = make_rows(n).assign(
        rollout_id=100 + 3 * np.arange(n), response_token_ids=[list(range(i % 4 + 1)) for i in range(n)]
    )
    uri = str(tmp_path / "advantages")
    version = write_frames([frame[:6], frame[6:]], uri, "advantages", run_id="r", iteration=0, lineage={"stage": "t"})
    return Partition(uri, "r", 0, version)


def _group(ranks: int) -> LocalGroup:
    return LocalGroup(Doubler, "doubler", [Doubler(i, ranks, 1) for i in range(ranks)])


def test_slices_read_their_rows_only_in_table_order(tmp_path) -> None:
    part = _rollouts(tmp_path)
    whole = store.read_partition(part.uri, "r", 0, version=part.version)
    columns = ("rollout_id", "response_token_ids", "no_such_column")  # not in the table: left out
    got = [Slice(part.uri, "r", 0, part.version, columns, a, b).read() for a, b in ((0, 4), (4, 9), (9, 11))]
    assert [list(g.columns) for g in got] == [["rollout_id", "response_token_ids"]] * 3
    pd.testing.assert_frame_equal(pd.concat(got, ignore_index=True), whole[["rollout_id", "response_token_ids"]])
    empty = Slice(part.uri, "r", 0, part.version, columns, 5, 5).read()
    assert len(empty) == 0 and empty["rollout_id"].dtype == whole["rollout_id"].dtype
    with pytest.raises(LookupError, match="'policy_version' is not unique"):
        Slice(part.uri, "r", 0, part.version, columns, 0, 3, key="policy_version").read()


def test_ranks_write_their_files_and_the_caller_commits_once(tmp_path) -> None:
    part, sink = _rollouts(tmp_path), Sink(str(tmp_path / "out"), "ref_logprobs", "r", 0)
    results = sharded_run(
        lambda: _group(3), Doubler.double, part, lambda shard: (shard, 1), columns=("rollout_id", "response_token_ids"),
        sink=sink, finish=count_tokens,
    )  # fmt: skip
    assert [r.frame for r in results] == [None] * 3 and [r.rows for r in results] == [4, 3, 4]  # round(i * 11 / 3)
    assert sum(r.summary["tokens"] for r in results) == sum(i % 4 + 1 for i in range(11))
    assert not store.table_exists(sink.uri)  # the ranks wrote files, no commit yet
    version = commit_shards(sink, results, {"stage": "ref_logprobs"})
    assert version == 0  # one commit made the table
    out = store.read_partition(sink.uri, "r", 0, version=version)
    assert out["rollout_id"].tolist() == list(100 + 3 * np.arange(11))  # table order: rank 0's file first
    assert out["policy_version"].tolist() == [0] * 4 + [1] * 3 + [2] * 4
    assert [list(x) for x in out["ref_logprobs"]] == [[2.0 * t + 1 for t in range(i % 4 + 1)] for i in range(11)]
    assert store.commit_lineage(sink.uri)[0]["stage"] == "ref_logprobs"


def test_every_rank_takes_part_and_an_empty_output_commits_nothing(tmp_path) -> None:
    part, sink = _rollouts(tmp_path, n=2), Sink(str(tmp_path / "out"), "ref_logprobs", "r", 0)
    results = sharded_run(lambda: _group(4), Doubler.double, part, lambda shard: (shard, 0), sink=sink, every_rank=True)
    assert [r.rows for r in results] == [1, 1, 0, 0]  # every rank called, the last ones empty: they write no file
    assert [len(r.files) for r in results] == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="refusing to write an empty partition"):
        commit_shards(sink, results[2:], {"stage": "t"})
    assert not store.table_exists(sink.uri)
