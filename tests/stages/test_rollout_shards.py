"""How a generation pass is cut and numbered before the ranks write it (stages/rollout_shards.py): pure pandas."""

from __future__ import annotations

import pandas as pd
import pytest

from stages.rollout_shards import FIRST_ID, ROW, NumberRollouts, in_batch_order, merge_summaries, rollout_order


def _samples(prompts: pd.DataFrame, n: int) -> pd.DataFrame:
    """What a rank's engine returns: each prompt row's columns, then n samples (in the rank's prompt order)."""
    rows = [
        {**p, "sample_index": k, "response_length": k, "engine": "hf", "engine_sync": "disk",
         "engine_weights_fingerprint": "f", "prompt_text": "q", "response_text": "a" * k, "finish_reason": "stop"}
        for p in prompts.to_dict("records")
        for k in range(n)
    ]  # fmt: skip
    return pd.DataFrame(rows)


def test_a_pass_numbers_its_rollouts_before_they_exist() -> None:
    prompts = pd.DataFrame({"prompt_id": [7, 2, 7, 5], "group_id": [0, 1, 2, 3]})
    ordered = rollout_order(prompts, n=3, first_id=100)
    # by hand: (prompt_id, row) ascending is 2 (row 1), 5 (row 3), 7 (row 0), 7 (row 2); 3 ids each from 100
    assert ordered["prompt_id"].tolist() == [2, 5, 7, 7] and ordered[ROW].tolist() == [1, 3, 0, 2]
    assert ordered[FIRST_ID].tolist() == [100, 103, 106, 109]
    rank = in_batch_order(ordered.iloc[2:])  # the second rank's run, back in the frame's row order
    assert rank["group_id"].tolist() == [0, 2]
    out, summary = NumberRollouts(3, {"gen_round": 1})(rank, _samples(rank, 3).iloc[::-1])
    assert out["rollout_id"].tolist() == list(range(106, 112)) and out["group_id"].tolist() == [0] * 3 + [2] * 3
    assert FIRST_ID not in out and ROW not in out and set(out["gen_round"]) == {1}
    assert summary["rows"] == 6 and summary["response_tokens"] == 2 * (0 + 1 + 2)
    assert summary["empty_responses"] == 2 and [s["rollout_id"] for s in summary["samples"]] == [106, 107, 108, 109]
    greedy, _ = NumberRollouts(1, {"is_baseline": True, "sample_index": -1})(rank, _samples(rank, 1))
    assert greedy["rollout_id"].tolist() == [106, 109] and set(greedy["sample_index"]) == {-1}


def test_an_engine_that_returns_another_count_is_refused() -> None:
    rank = rollout_order(pd.DataFrame({"prompt_id": [0, 1], "group_id": [0, 1]}), n=2)
    with pytest.raises(ValueError, match="returned 3 samples for 2 prompts, not rollout.n = 2"):
        NumberRollouts(2)(rank, _samples(rank, 2).iloc[:3])
    with pytest.raises(ValueError, match="returned 0 samples for 2 prompts"):
        NumberRollouts(2)(rank, pd.DataFrame())
    with pytest.raises(ValueError, match="not rollout.n = 2"):  # right count, one sample twice
        NumberRollouts(2)(rank, _samples(rank, 2).assign(sample_index=[0, 0, 0, 1]))


def test_the_ranks_summaries_merge_into_the_partitions() -> None:
    rank = rollout_order(pd.DataFrame({"prompt_id": [0, 1, 2], "group_id": [0, 1, 2]}), n=2)
    parts = [
        NumberRollouts(2, {"gen_round": 0})(rank.iloc[a:b], _samples(rank.iloc[a:b], 2))[1] for a, b in [(1, 3), (0, 1)]
    ]
    merged = merge_summaries(parts)
    assert merged["rows"] == 6 and merged["fingerprints"] == {"f": 6} and merged["gen_rounds"] == [0]
    assert [s["rollout_id"] for s in merged["samples"]] == [0, 1, 2, 3]  # the first 4 by id, whichever rank
