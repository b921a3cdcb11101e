"""The advantages stage streamed (#36, stages/advantages.py) gives the rows the whole-frame computation
(stages.advantage_table.iteration_advantages) gave, row for row and bit for bit, for every estimator and option, at
batch sizes that split groups: its table's own columns, and the token and log-prob columns its readers join from
the rollouts / old / ref / teacher tables (stages.io.advantage_rows) equal the copies the table held before.
Real Delta tables under tmp_path."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from deltalake import write_deltalake

from configs.schema import AlgorithmConfig, DistillationConfig, FilterGroupsConfig, KLControlConfig
from stages.advantage_table import iteration_advantages
from stages.advantages import Upstream, stream_advantages
from stages.io import store
from stages.io.advantage_rows import JOINED, JoinedAdvantages
from stages.io.stage_exec import Partition, write_frames
from stages.scored_tokens import ScoredRollouts

RUN = "s"
N = 48


def _scored(rng: np.random.Generator, *, remax: bool, shuffled: bool) -> pd.DataFrame:
    """N scored rollouts in groups of 8: a flagged (NaN) reward, an all-equal group, multi-turn masks on every
    fifth row (a 1-token one all 0), engine log-probs; with remax a greedy baseline row per group; shuffled: out
    of rollout_id order."""
    lengths = rng.integers(1, 12, N)
    reward = rng.integers(0, 2, N).astype(np.float64)
    reward[:8], reward[9] = 1.0, np.nan
    multi = np.arange(N) % 5 == 0
    df = pd.DataFrame(
        {
            "rollout_id": np.arange(N),
            "group_id": np.arange(N) // 8,
            "policy_version": 0,
            "prompt_token_ids": [list(range(k)) for k in rng.integers(2, 9, N)],
            "response_token_ids": [list(range(k)) for k in lengths],
            "rollout_logprobs": [list(-rng.exponential(0.5, k)) for k in lengths],
            "response_mask": [[1] * (k - 1) + [0] if m else None for k, m in zip(lengths, multi)],
            "response_length": lengths.astype(np.int32),
            "reward": reward,
            "score": reward,
            **{"prompt_id": np.arange(N) // 8, "sample_index": np.arange(N) % 8, "data_source": "openai/gsm8k"},
            **{"ground_truth": "1", "prompt_text": "q", "response_text": "#### 1", "finish_reason": "stop"},
            **{"engine": "hf", "engine_sync": "build", "engine_weights_fingerprint": "x", "reward_fn": "gsm8k"},
            **{"reward_error": None, "overlong_penalty": 0.0},
        }
    )
    if remax:
        df["is_baseline"] = np.arange(N) % 8 == 7
    return df.sample(frac=1.0, random_state=0).reset_index(drop=True) if shuffled else df


def _token_table(
    scored: pd.DataFrame, column: str, rng: np.random.Generator, ascending: bool = False, **extra
) -> pd.DataFrame:
    """A per-token upstream table (old/ref/teacher log-probs, values) of the rollouts, in reverse order (or in
    rollout_id order: ascending)."""
    rows = scored.sort_values("rollout_id", ascending=ascending)
    lists = [list(-rng.exponential(0.5, int(k))) for k in rows["response_length"]]
    return pd.DataFrame({"rollout_id": rows["rollout_id"].to_numpy(), column: lists, **extra})


def _write(tmp_path, name: str, df: pd.DataFrame, it: int = 1, files: int = 1) -> Partition | ScoredRollouts:
    """The partition written as `files` Parquet files (a Ray-block write's layout), in the frame's row order.
    scored_rollouts: its token columns go to a rollouts partition, as the stages write them (scored_tokens.py)."""
    if name == "scored_rollouts":
        return ScoredRollouts(
            _write(tmp_path, name + "_table", df, it, files), _write(tmp_path, "rollouts", df, it, files)
        )
    table = name.removesuffix("_table")
    uri = str(tmp_path / name)
    if files == 1:
        version = store.write_partition(uri, table, df, run_id=RUN, iteration=it, lineage={})
    else:
        frames = [df.iloc[rows] for rows in np.array_split(np.arange(len(df)), files)]
        version = write_frames(frames, uri, table, run_id=RUN, iteration=it, lineage={})
    return Partition(uri, RUN, it, version)


def _read(part: Partition | None) -> pd.DataFrame | None:
    return None if part is None else pd.concat(list(part.batches()), ignore_index=True)


CASES = {
    "grpo": AlgorithmConfig(),
    "dr_grpo": AlgorithmConfig(norm_adv_by_std_in_grpo=False),
    "rloo": AlgorithmConfig(adv_estimator="rloo"),
    "opo": AlgorithmConfig(adv_estimator="opo"),
    "reinforce_pp": AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=0.9),
    "reinforce_pp_baseline": AlgorithmConfig(adv_estimator="reinforce_plus_plus_baseline"),
    "remax": AlgorithmConfig(adv_estimator="remax"),
    "gae": AlgorithmConfig(adv_estimator="gae", gamma=0.95, lam=0.9),
    "gae_kl_in_reward": AlgorithmConfig(adv_estimator="gae", use_kl_in_reward=True),
    "grpo_kl_adaptive": AlgorithmConfig(use_kl_in_reward=True, kl_ctrl=KLControlConfig(type="adaptive")),
    "grpo_distill": AlgorithmConfig(distillation=DistillationConfig(enable=True, teacher_model_path="t")),
    "grpo_filter_groups": AlgorithmConfig(filter_groups=FilterGroupsConfig(enable=True, metric="acc")),
}


def _cfg(alg: AlgorithmConfig):
    return SimpleNamespace(
        algorithm=alg, reward=SimpleNamespace(on_error="flag", score=1.0), data=SimpleNamespace(train_batch_size=3)
    )


def _upstream(tmp_path, alg: AlgorithmConfig, *, shuffled: bool = False, in_order: bool = False) -> Upstream:
    """The upstream partitions; in_order: the per-token tables in rollout_id order, as 3 files each."""
    rng, files = np.random.default_rng(0), 3 if in_order else 1
    table = partial(_token_table, rng=rng, ascending=in_order)
    scored = _scored(rng, remax=alg.adv_estimator == "remax", shuffled=shuffled)
    gap = {"rollout_probs_diff_max": rng.random(N), "rollout_probs_diff_mean": rng.random(N)}
    previous = None
    if alg.kl_ctrl.type == "adaptive":  # the previous iteration's stored beta and per-rollout KL
        prev = pa.table({"run_id": [RUN] * N, "iteration": [0] * N, "kl_coef": [0.05] * N, "reward_kl": rng.random(N)})
        write_deltalake(str(tmp_path / "previous"), prev, partition_by=["run_id", "iteration"])
        previous = Partition(str(tmp_path / "previous"), RUN, 0, None)
    return Upstream(
        scored=_write(tmp_path, "scored_rollouts", scored),
        old=_write(tmp_path, "old_logprobs", table(scored, "old_logprobs", policy_version=0, **gap), files=files),
        ref=_write(
            tmp_path,
            "ref_logprobs",
            table(scored, "ref_logprobs", policy_version=0, ref_policy_version=0),
            files=files,
        ),
        values=_write(tmp_path, "values", table(scored, "values", critic_version=0), files=files),
        teacher=_write(tmp_path, "teacher_logprobs", table(scored, "teacher_logprobs", policy_version=0), files=files),
        previous=previous,
    )


def _whole_frame_table(tmp_path, cfg, up: Upstream) -> pd.DataFrame:
    """What the asset wrote before #36: the whole frames through iteration_advantages, the table written whole."""
    frames = {k: _read(getattr(up, k)) for k in ("values", "ref", "old", "teacher", "previous")}
    adv, _ = iteration_advantages(cfg, _read(up.scored), **frames)
    uri = str(tmp_path / "whole")
    return _read(
        Partition(uri, RUN, 1, store.write_partition(uri, "advantages", adv, run_id=RUN, iteration=1, lineage={}))
    )


def _lineage(up: Upstream) -> dict:
    """The versions the advantages asset records (its inputs'), which its readers join at."""
    parts = {"rollouts": up.scored.rollouts, "old_logprobs": up.old, "ref_logprobs": up.ref}
    parts |= {"teacher_logprobs": up.teacher, "values": up.values}
    return {"upstream": {t: p.version for t, p in parts.items() if p is not None}}


def _stream(cfg, up: Upstream, tmp_path, **kw):
    return stream_advantages(cfg, up, str(tmp_path / "advantages"), lineage=_lineage(up), **kw)


def _rows(tmp_path, version: int) -> pd.DataFrame:
    """The streamed table's rows as its readers see them (the joined columns from their tables); the table itself
    holds none of them."""
    part = Partition(str(tmp_path / "advantages"), RUN, 1, version)
    assert not set(JOINED) & set(part.columns())
    return JoinedAdvantages.of(part).read()


def _assert_same(streamed: pd.DataFrame, whole: pd.DataFrame) -> None:
    assert sorted(streamed.columns) == sorted(whole.columns)
    for column in whole.columns:  # repr: exact floats, NaN == NaN, list against list
        a = [repr(np.asarray(v).tolist()) for v in streamed[column]]
        b = [repr(np.asarray(v).tolist()) for v in whole[column]]
        assert a == b, column


@pytest.mark.parametrize("batch_rows", [None, 5, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_table_equals_the_whole_frame_one(tmp_path, case: str, batch_rows: int | None) -> None:
    cfg = _cfg(CASES[case])
    up = _upstream(tmp_path, cfg.algorithm)
    run = _stream(cfg, up, tmp_path, batch_rows=batch_rows)
    assert run.mode == "streamed"
    streamed = _rows(tmp_path, run.version)
    whole = _whole_frame_table(tmp_path, cfg, up)
    _assert_same(streamed, whole)
    assert run.dropped == 1  # reward[9] is NaN
    np.testing.assert_array_equal(run.summary["advantage"].to_numpy(), whole["advantage"].to_numpy())
    files = store.open_table(str(tmp_path / "advantages")).to_pyarrow_dataset().get_fragments()
    assert (len(list(files)) > 2) if batch_rows else (len(list(files)) == 1)  # a file per batch with kept rows


@pytest.mark.parametrize("batch_rows", [None, 5, 3])
@pytest.mark.parametrize("case", ["grpo", "reinforce_pp", "gae_kl_in_reward", "grpo_distill", "grpo_filter_groups"])
def test_joined_tables_in_rollout_order_are_merged_batch_by_batch(
    tmp_path, monkeypatch, case: str, batch_rows: int | None
) -> None:
    """Per-token tables in the kept order (the pipeline's case, here over 3 files each, with rows the stage
    drops) are read a record batch at a time alongside scored_rollouts, never whole: the same table."""
    cfg = _cfg(CASES[case])
    up = _upstream(tmp_path, cfg.algorithm, in_order=True)
    whole = _whole_frame_table(tmp_path, cfg, up)

    def no_whole_read(self, columns):
        raise AssertionError(f"{self.uri} read whole")

    monkeypatch.setattr(Partition, "arrow", no_whole_read)
    run = _stream(cfg, up, tmp_path, batch_rows=batch_rows)
    assert run.mode == "streamed"
    _assert_same(_rows(tmp_path, run.version), whole)


def test_out_of_order_partition_with_group_filter_falls_back_to_the_whole_frame(tmp_path) -> None:
    """DAPO's filter orders the kept rows by rollout_id: a scored partition out of that order cannot be streamed
    in today's row order, so the stage takes the explicit whole-frame path, with the same table."""
    cfg = _cfg(CASES["grpo_filter_groups"])
    up = _upstream(tmp_path, cfg.algorithm, shuffled=True)
    run = _stream(cfg, up, tmp_path, batch_rows=4)
    assert run.mode == "whole-frame"
    _assert_same(_rows(tmp_path, run.version), _whole_frame_table(tmp_path, cfg, up))


def test_shuffled_partition_without_filter_streams(tmp_path) -> None:
    cfg = _cfg(CASES["grpo"])
    up = _upstream(tmp_path, cfg.algorithm, shuffled=True)
    run = _stream(cfg, up, tmp_path, batch_rows=4)
    assert run.mode == "streamed"
    _assert_same(_rows(tmp_path, run.version), _whole_frame_table(tmp_path, cfg, up))


def test_missing_old_logprobs_rows_name_the_rollouts(tmp_path) -> None:
    cfg = _cfg(CASES["grpo"])
    up = _upstream(tmp_path, cfg.algorithm)
    old = _read(up.old)
    short = Partition(
        str(tmp_path / "old2"),
        RUN,
        1,
        store.write_partition(
            str(tmp_path / "old2"),
            "old_logprobs",
            old[old["rollout_id"] != 3].drop(columns=["run_id", "iteration"], errors="ignore"),
            run_id=RUN,
            iteration=1,
            lineage={},
        ),
    )
    with pytest.raises(ValueError, match=r"rollouts \[3\] have no old log-probs"):
        stream_advantages(cfg, Upstream(up.scored, old=short), str(tmp_path / "advantages"), lineage={})
