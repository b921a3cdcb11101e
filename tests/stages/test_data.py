"""Dataset ingest (verl parquet), the synthetic task, and the seeded epoch cursor."""

from __future__ import annotations

import pandas as pd
import pytest

from configs.schema import SyntheticTaskConfig
from stages.data.datasets import generate_arith_task, load_prompt_rows, read_verl_parquet, sample_prompt_batch


def test_synthetic_task_is_verl_format_deterministic_and_disjoint(tmp_path) -> None:
    cfg = SyntheticTaskConfig(num_train=300, num_val=20, max_operand=19)
    train, val = generate_arith_task(tmp_path / "a", cfg)
    train2, _ = generate_arith_task(tmp_path / "b", cfg)
    t, v = pd.read_parquet(train), pd.read_parquet(val)
    assert t.equals(pd.read_parquet(train2))
    assert list(t.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert not set(t["prompt"].map(lambda m: m[0]["content"])) & set(v["prompt"].map(lambda m: m[0]["content"]))
    row = t.iloc[0]
    a, b = row["prompt"][0]["content"].rstrip("=").split("+")
    assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))


def test_missing_columns_are_named(tmp_path) -> None:
    path = tmp_path / "bad.parquet"
    pd.DataFrame({"data_source": ["x"], "prompt": [[{"role": "user", "content": "hi"}]]}).to_parquet(path)
    with pytest.raises(ValueError, match=r"missing verl columns \['ability', 'reward_model', 'extra_info'\]"):
        read_verl_parquet(path, "train")


def test_malformed_prompt_is_named(tmp_path) -> None:
    path = tmp_path / "bad.parquet"
    pd.DataFrame(
        {
            "data_source": ["x"],
            "prompt": [[{"role": "user", "text": "hi"}]],
            "ability": ["m"],
            "reward_model": [{"style": "rule", "ground_truth": "1"}],
            "extra_info": [{"a": 1}],
        }
    ).to_parquet(path)
    with pytest.raises((ValueError, KeyError), match="content|prompt"):
        read_verl_parquet(path, "train")


def test_load_prompt_rows_assigns_dense_ids(tmp_path) -> None:
    train, val = generate_arith_task(tmp_path, SyntheticTaskConfig(num_train=30, num_val=5, max_operand=9))
    df = load_prompt_rows([train], [val])
    assert df["prompt_id"].tolist() == list(range(35))
    assert (df["split"] == "val").sum() == 5


def test_cursor_is_resumable_and_covers_each_epoch_once() -> None:
    ids = list(range(10))
    batches = [sample_prompt_batch(ids, it, 4, seed=3, shuffle=True) for it in range(5)]  # 20 positions = 2 epochs
    flat = [p for b in batches for p in b]
    assert [pos for _, _, pos in flat] == list(range(20))
    epoch0 = [pid for pid, ep, _ in flat if ep == 0]
    epoch1 = [pid for pid, ep, _ in flat if ep == 1]
    assert sorted(epoch0) == ids and sorted(epoch1) == ids and epoch0 != epoch1
    assert sample_prompt_batch(ids, 3, 4, seed=3, shuffle=True) == batches[3]  # same data after a restart
    with pytest.raises(ValueError, match="exceeds the 10 training prompts"):
        sample_prompt_batch(ids, 0, 11, seed=0, shuffle=False)
