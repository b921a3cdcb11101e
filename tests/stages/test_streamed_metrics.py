"""The iteration_metrics stage streams its partitions (#36): metrics from batches of only the columns it needs
equal those of the whole-frame computation on the same Delta partitions. Real Delta tables under tmp_path."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from stages.algos.probs_diff import PROBS_DIFF_KEYS
from stages.io import store
from stages.io.stage_exec import Partition, iter_partition_batches, run_table_stage
from stages.iteration_metrics import iteration_metrics, rollout_metrics
from stages.scored_tokens import ScoredRollouts

RUN = "m"


def _turns(k: int, error: bool) -> list[dict]:
    tool = {"turn_index": 1, "role": "tool", "token_start": 1, "token_end": k, "error": "timeout" if error else None}
    return [{"turn_index": 0, "role": "assistant", "token_start": 0, "token_end": 1, "error": None}, tool]


def _scored(n: int, rng: np.random.Generator) -> pd.DataFrame:
    """n scored rollouts in groups of 8 with every column the metrics read: flagged (NaN) and all-equal groups,
    ReMax baselines, multi-turn masks and turns, length cut-offs, two generation rounds, model scores."""
    lengths = rng.integers(1, 12, n)
    reward = rng.integers(0, 2, n).astype(np.float64)
    reward[:8], reward[9] = 1.0, np.nan
    multi = np.arange(n) % 5 == 0
    return pd.DataFrame(
        {
            **{"rollout_id": np.arange(n), "group_id": np.arange(n) // 8, "prompt_id": np.arange(n) // 8},
            "sample_index": np.arange(n) % 8,
            "policy_version": 0,
            "prompt_token_ids": [list(range(k)) for k in rng.integers(2, 9, n)],
            "response_token_ids": [list(range(k)) for k in lengths],
            "rollout_logprobs": [list(-rng.exponential(0.5, k)) for k in lengths],
            "response_mask": [[1] + [0] * (k - 1) if m else None for k, m in zip(lengths, multi, strict=True)],
            "turns": [
                _turns(k, i % 2 == 0) if m else None for i, (k, m) in enumerate(zip(lengths, multi, strict=True))
            ],
            "response_length": lengths.astype(np.int32),
            "finish_reason": np.where(rng.random(n) < 0.3, "length", "stop"),
            "is_baseline": np.arange(n) % 8 == 7,
            "gen_round": (np.arange(n) >= n // 2).astype(np.int32),
            **{"data_source": "openai/gsm8k", "ground_truth": "1", "response_text": "#### 1", "prompt_text": "q"},
            **{"engine": "hf", "engine_sync": "build", "engine_weights_fingerprint": "x", "reward_fn": "gsm8k"},
            "reward": reward,
            "score": reward,
            "overlong_penalty": -rng.random(n) * (rng.random(n) < 0.2),
            "rm_score": rng.normal(size=n),
            "judge_score": np.where(rng.random(n) < 0.5, rng.random(n), np.nan),
            "judge_error": [None if i % 3 else "unparsed" for i in range(n)],
            "reward_error": None,
        }
    )


def _advantages(scored: pd.DataFrame, rng: np.random.Generator) -> pd.DataFrame:
    """The training rows (finite reward, no baseline) in another order, with old log-probs near the engine's."""
    rows = scored[np.isfinite(scored["reward"]) & ~scored["is_baseline"]].sample(frac=1.0, random_state=1)
    old = [list(np.asarray(x) + rng.normal(0, 0.05, len(x))) for x in rows["rollout_logprobs"]]
    return rows[["rollout_id", "group_id", "policy_version", "prompt_token_ids", "response_token_ids"]].assign(
        response_mask=rows["response_mask"].to_numpy(),
        rollout_logprobs=rows["rollout_logprobs"].to_numpy(),
        reward=rows["reward"].to_numpy(),
        advantage=rng.normal(size=len(rows)),
        token_advantages=[[0.5] * len(x) for x in rows["response_token_ids"]],
        adv_estimator="grpo",
        old_logprobs=old,
        kl_coef=0.01,
        reward_kl=rng.random(len(rows)),
    )


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> dict[str, str]:
    root, rng = tmp_path_factory.mktemp("lake"), np.random.default_rng(0)
    scored = _scored(64, rng)
    uris = {t: str(root / t) for t in ("scored_rollouts", "rollouts", "advantages")}
    store.write_partition(uris["scored_rollouts"], "scored_rollouts", scored, run_id=RUN, iteration=0, lineage={})
    store.write_partition(uris["rollouts"], "rollouts", scored, run_id=RUN, iteration=0, lineage={})  # the tokens
    adv = _advantages(scored, rng)
    store.write_partition(uris["advantages"], "advantages", adv, run_id=RUN, iteration=0, lineage={})
    return uris


def _same(a: dict, b: dict, rel: float = 0.0) -> None:
    assert list(a) == list(b)
    for k in a:
        both_nan = math.isnan(a[k]) and math.isnan(b[k])
        assert both_nan or a[k] == pytest.approx(b[k], rel=rel, abs=0), k


@pytest.mark.parametrize("batch_rows", [None, 7])
def test_streamed_metrics_equal_the_whole_frame(lake, batch_rows) -> None:
    scored = ScoredRollouts(Partition(lake["scored_rollouts"], RUN, 0, 0), Partition(lake["rollouts"], RUN, 0, 0))
    adv = Partition(lake["advantages"], RUN, 0, 0)
    whole = rollout_metrics(scored.read(), store.read_partition(lake["advantages"], RUN, 0), 16)
    assert {"multi_turn/tool_error_rate", "response_length/model_tokens_mean", *PROBS_DIFF_KEYS} <= set(whole)
    streamed = iteration_metrics(scored, adv, update_metrics={}, timings={}, batch_rows=batch_rows)
    del streamed["timing_s/step"]
    per_row = {k: v for k, v in whole.items() if k not in PROBS_DIFF_KEYS}
    _same(per_row, {k: v for k, v in streamed.items() if k not in PROBS_DIFF_KEYS})  # the same numbers per row
    gap = {k: streamed[k] for k in PROBS_DIFF_KEYS}  # token sums merged across batches: equal to rounding
    _same({k: whole[k] for k in PROBS_DIFF_KEYS}, gap, rel=0.0 if batch_rows is None else 1e-9)


def test_batches_fill_columns_older_files_lack(tmp_path) -> None:
    """A column the table gained after a partition was written comes back null, as a whole read has it."""
    uri, rng = str(tmp_path / "scored_rollouts"), np.random.default_rng(1)
    old = _scored(16, rng)
    store.write_partition(uri, "scored_rollouts", old, run_id=RUN, iteration=0, lineage={})
    new = _scored(16, rng).assign(reward_extra_keys=[["acc"]] * 16, acc=1.0)  # a custom reward's extra key
    store.write_partition(uri, "scored_rollouts", new, run_id=RUN, iteration=1, lineage={})
    (batch,) = iter_partition_batches(uri, RUN, 0, columns=["reward", "acc", "no_such_column"])
    assert list(batch.columns) == ["reward", "acc"] and batch["acc"].isna().all()
    assert batch["reward"].equals(store.read_partition(uri, RUN, 0)["reward"])


def test_batches_read_files_written_from_arrow_backed_frames(tmp_path) -> None:
    """A stage output whose frame has Arrow-backed columns (Ray Data's pandas batches) streams back as a whole
    read gives it (the files used to carry pandas metadata naming dtypes pandas cannot parse back)."""
    source, target = str(tmp_path / "rollouts"), str(tmp_path / "out")
    store.write_partition(
        source, "rollouts", _scored(16, np.random.default_rng(2)), run_id=RUN, iteration=0, lineage={}
    )
    tokens = pd.ArrowDtype(pa.list_(pa.int32()))
    arrow_backed = lambda df: df.assign(prompt_token_ids=pd.array(df["prompt_token_ids"].tolist(), dtype=tokens))  # noqa: E731
    run_table_stage(arrow_backed, source, target, "rollouts", run_id=RUN, iteration=0, version=None, lineage={})
    (batch,) = iter_partition_batches(target, RUN, 0)
    assert (
        batch["prompt_token_ids"].map(list).tolist()
        == store.read_partition(target, RUN, 0)["prompt_token_ids"].map(list).tolist()
    )


@pytest.mark.parametrize("batch_rows", [None, 5])
@pytest.mark.parametrize("values_order", ["kept", "shuffled"])
def test_streamed_critic_metrics_equal_the_whole_frame(tmp_path, batch_rows, values_order) -> None:
    """PPO with a critic: the values partition joined batch by batch (merge join in the kept order, or taken whole
    when written in another order) gives critic_data_metrics' numbers; multi-turn observation tokens and a row
    without a mask counted as the frame version counts them."""
    from stages.iteration_metrics import streamed_critic_data_metrics
    from stages.train.critic import critic_data_metrics

    rng = np.random.default_rng(3)
    adv = _advantages(_scored(48, rng), rng)
    adv = adv.assign(
        token_advantages=[list(rng.normal(size=len(x))) for x in adv["response_token_ids"]],
        returns=[list(rng.normal(size=len(x))) for x in adv["response_token_ids"]],
        adv_estimator="gae",
    )
    vals = pd.DataFrame(
        {"rollout_id": adv["rollout_id"], "values": [list(r + rng.normal(0, 0.3, len(r))) for r in adv["returns"]]}
    )
    vals = vals.sample(frac=1.0, random_state=2) if values_order == "shuffled" else vals
    uris = {t: str(tmp_path / t) for t in ("advantages", "values")}
    store.write_partition(uris["advantages"], "advantages", adv, run_id=RUN, iteration=0, lineage={})
    store.write_partition(uris["values"], "values", vals.assign(critic_version=0), run_id=RUN, iteration=0, lineage={})
    whole = critic_data_metrics(
        store.read_partition(uris["advantages"], RUN, 0), store.read_partition(uris["values"], RUN, 0)
    )
    streamed = streamed_critic_data_metrics(
        Partition(uris["advantages"], RUN, 0, 0), Partition(uris["values"], RUN, 0, 0), batch_rows
    )
    assert 0.0 < whole["critic/vf_explained_var"] < 1.0
    _same(whole, streamed, rel=1e-6)  # float32 values, summed in another order
