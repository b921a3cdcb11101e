"""Non-string ground truths (stages.data.rewards.canonical_ground_truth): one rule for every math scorer and
for the prompts table a verl parquet is read into."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from stages.data.datasets import read_verl_parquet
from stages.data.rewards import canonical_ground_truth, score_gsm8k, score_math, score_math_dapo


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("7.0", "7.0"),  # a string is never rewritten
        (7, "7"),
        (np.int64(-12), "-12"),
        (7.0, "7"),  # a whole float: its digits, so it matches "#### 7"
        (np.float64(-3.0), "-3"),
        (0.5, "0.5"),  # else the shortest repr
        (1e-7, "1e-07"),
    ],
)
def test_canonical_text(value, text):
    assert canonical_ground_truth(value) == text


@pytest.mark.parametrize("value", [None, True, np.bool_(False), [7], {"a": 1}])
def test_not_a_string_or_number_is_a_type_error(value):
    with pytest.raises(TypeError, match="not a string or a number"):
        canonical_ground_truth(value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_not_finite_is_a_value_error(value):
    with pytest.raises(ValueError, match="not a finite number"):
        canonical_ground_truth(value)


def test_every_math_scorer_compares_the_canonical_text():
    # gsm8k extracts "7" from "#### 7": equal to 7 and 7.0 (as "7"), not to "7.0" (a string stays as is)
    assert score_gsm8k("#### 7", 7) == score_gsm8k("#### 7", 7.0) == score_gsm8k("#### 7", np.int64(7)) == 1.0
    assert score_gsm8k("#### 7", "7.0", format_score=0.1) == 0.1
    assert score_gsm8k("#### 0.5", 0.5) == 1.0
    assert score_math("so \\boxed{7}", 7) == score_math("so \\boxed{0.5}", 0.5) == 1.0
    assert score_math_dapo("Answer: 7", 7.0) == {"score": 1.0, "acc": True, "pred": "7"}
    with pytest.raises(TypeError, match="ground truth None"):
        score_gsm8k("#### 7", None)


def test_parquet_ground_truths_are_stored_as_the_canonical_text(tmp_path):
    def write(gts: list) -> str:
        path = tmp_path / f"d{len(list(tmp_path.iterdir()))}.parquet"
        pd.DataFrame(
            {
                "data_source": "openai/gsm8k",
                "prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(len(gts))],
                "ability": "math",
                "reward_model": [{"style": "rule", "ground_truth": gt} for gt in gts],
                "extra_info": [{"index": i} for i in range(len(gts))],
            }
        ).to_parquet(path)
        return str(path)

    rows = read_verl_parquet(write([7.0, 0.5, 12.0]), "train")  # a float column (pyarrow: double)
    assert [rm["ground_truth"] for rm in rows["reward_model"]] == ["7", "0.5", "12"]
    rows = read_verl_parquet(write([7, -2]), "train")
    assert [rm["ground_truth"] for rm in rows["reward_model"]] == ["7", "-2"]
    with pytest.raises(ValueError, match=r"row 1: reward_model.ground_truth: ground truth inf is not a finite"):
        read_verl_parquet(write([1.0, float("inf")]), "train")  # (a NaN reaches pandas as None: "must be a struct")
