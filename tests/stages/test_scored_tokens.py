"""scored_rollouts stores no token column; ScoredRollouts reads its partitions with the rollouts' token columns
(stages/scored_tokens.py). Real Delta tables under tmp_path."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from configs.schema import RewardConfig
from stages.io import store
from stages.io.stage_exec import Partition
from stages.io.tables import ROLLOUT_TOKEN_COLUMNS, SCHEMAS
from stages.scored_rollouts import score_partition
from stages.scored_tokens import ScoredRollouts

RUN = "t"


def _rollouts(n: int, rng: np.random.Generator) -> pd.DataFrame:
    lengths = rng.integers(1, 9, n)
    return pd.DataFrame(
        {
            "policy_version": 0,
            "rollout_id": np.arange(n),
            "prompt_id": np.arange(n) // 4,
            "group_id": np.arange(n) // 4,
            "sample_index": np.arange(n) % 4,
            "data_source": "openai/gsm8k",
            "ground_truth": "3",
            "prompt_text": "q",
            "prompt_token_ids": [list(rng.integers(0, 50, 3)) for _ in range(n)],
            "response_token_ids": [list(rng.integers(0, 50, k)) for k in lengths],
            "rollout_logprobs": [list(-rng.random(k)) for k in lengths],
            "response_mask": [[1] * k if i % 3 == 0 else None for i, k in enumerate(lengths)],
            "response_text": ["#### 3" if i % 2 else "#### 4" for i in range(n)],
            "response_length": lengths.astype(np.int32),
            "finish_reason": "stop",
            **{"engine": "hf", "engine_sync": "build", "engine_weights_fingerprint": "f"},
        }
    )


def _plain(frame: pd.DataFrame) -> list:
    return [[list(v) if isinstance(v, (list, np.ndarray)) else v for v in row] for row in frame.itertuples(index=False)]


@pytest.mark.parametrize("rollouts_order", ["same", "shuffled"])
def test_scored_partitions_read_the_rollouts_token_columns(tmp_path, rollouts_order) -> None:
    rng = np.random.default_rng(0)
    rollouts = _rollouts(20, rng)
    uris = {t: str(tmp_path / t) for t in ("rollouts", "scored_rollouts")}
    v = store.write_partition(uris["rollouts"], "rollouts", rollouts, run_id=RUN, iteration=0, lineage={})
    run = score_partition(
        RewardConfig(), uris["rollouts"], uris["scored_rollouts"], run_id=RUN, iteration=0, version=v, lineage={}
    )
    if rollouts_order == "shuffled":  # the same rollouts in another order: taken whole into the scored order
        shuffled = rollouts.sample(frac=1.0, random_state=3)
        v = store.write_partition(uris["rollouts"], "rollouts", shuffled, run_id=RUN, iteration=0, lineage={})
    # the table stores no token column: they are the rollouts'
    assert not set(ROLLOUT_TOKEN_COLUMNS) & set(store.open_table(uris["scored_rollouts"]).schema().to_arrow().names)
    assert not set(ROLLOUT_TOKEN_COLUMNS) & set(SCHEMAS["scored_rollouts"].names)
    view = ScoredRollouts(
        Partition(uris["scored_rollouts"], RUN, 0, run.version), Partition(uris["rollouts"], RUN, 0, v)
    )
    assert {"reward", "response_token_ids", "response_mask"} <= set(view.columns())
    columns = ["rollout_id", "reward", "response_token_ids", "prompt_token_ids", "response_mask"]
    got = pd.concat(list(view.batches(columns, batch_rows=3)), ignore_index=True)
    scored = store.read_partition(uris["scored_rollouts"], RUN, 0)
    want = scored[["rollout_id", "reward"]].merge(rollouts, on="rollout_id")[columns]  # in the scored order
    assert list(got.columns) == columns and _plain(got) == _plain(want)
    only = list(view.record_batches(["response_mask"], batch_rows=7))  # token columns only: batch sizes kept
    assert [b.schema.names for b in only] == [["response_mask"]] * len(only) and sum(b.num_rows for b in only) == 20
    assert _plain(view.read(["rollout_id", "turns"])) == _plain(want[["rollout_id"]].assign(turns=None))


def test_a_scored_rollout_the_rollouts_lack_is_a_clear_error(tmp_path) -> None:
    rng = np.random.default_rng(1)
    uris = {t: str(tmp_path / t) for t in ("rollouts", "scored_rollouts", "other")}
    v = store.write_partition(uris["rollouts"], "rollouts", _rollouts(8, rng), run_id=RUN, iteration=0, lineage={})
    run = score_partition(
        RewardConfig(), uris["rollouts"], uris["scored_rollouts"], run_id=RUN, iteration=0, version=v, lineage={}
    )
    w = store.write_partition(uris["other"], "rollouts", _rollouts(4, rng), run_id=RUN, iteration=0, lineage={})
    view = ScoredRollouts(Partition(uris["scored_rollouts"], RUN, 0, run.version), Partition(uris["other"], RUN, 0, w))
    with pytest.raises(ValueError, match=r"scored rollouts \[4, 5, 6, 7\] are not in the rollouts partition"):
        view.read(["response_token_ids"])
