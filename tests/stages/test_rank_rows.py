"""Each trainer rank reads only its shard of the advantages partition (stages/workers/actor_worker.py:
rank_partition): the rows and values are exactly the whole sorted partition's shard_for_rank slice, for any
world size, in rollout_id order, with only the columns the update reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from configs.schema import ActorConfig
from stages.io import store
from stages.train.ppo_loop import shard_for_rank
from stages.workers.actor_worker import ROW_COLUMNS, rank_partition
from stages.workers.requests import UpdateRequest

sys.path.insert(0, str(Path(__file__).parent))
from helpers_rollouts import make_rows


@pytest.mark.parametrize("world", [1, 2, 3, 20])
def test_each_rank_reads_exactly_its_shard(tmp_path, world) -> None:
    df = make_rows(16, seed=3).sample(frac=1.0, random_state=0)  # stored out of rollout_id order
    uri = str(tmp_path / "advantages")
    version = store.write_partition(uri, "advantages", df, run_id="r", iteration=2, lineage={"stage": "test"})
    store.write_partition(uri, "advantages", make_rows(16, seed=4), run_id="r", iteration=3, lineage={})
    req = UpdateRequest(
        run_id="r",
        iteration=2,
        advantages_uri=uri,
        advantages_version=version,
        policy_dir="unused",
        out_dir="unused",
        actor=ActorConfig(ppo_mini_batch_size=2, num_workers=world),
        n_per_prompt=4,
        seed=0,
    )
    whole = store.read_partition(uri, "r", 2, version=version).sort_values("rollout_id").reset_index(drop=True)
    columns = [c for c in ROW_COLUMNS if c in whole.columns]
    parts = [rank_partition(req, rank, world) for rank in range(world)]
    for rank, part in enumerate(parts):
        want = whole.iloc[shard_for_rank(len(whole), 8, rank, world)][columns].reset_index(drop=True)
        assert list(part.columns) == columns
        pd.testing.assert_frame_equal(part, want, check_dtype=False)
    assert sum(len(p) for p in parts) == 16
