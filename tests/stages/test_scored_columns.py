"""The scored_rollouts stage reads only the rollouts columns it needs (stages/scored_rollouts.py scored_columns):
without a reward model the token columns are never read, in-process or on Ray Data, and the scored table is the
one a read of every column gives. Real Delta tables under tmp_path; "never read" is shown with a rollouts file
whose token column chunks are overwritten with garbage (reading any of them raises)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from configs.schema import RewardConfig, RunConfig
from stages.io import stage_exec, store
from stages.io.tables import ROLLOUT_TOKEN_COLUMNS, SCHEMAS
from stages.scored_rollouts import (
    SCORER_READS,
    ModelScores,
    ScoreBatch,
    reward_stage,
    score_partition,
    scored_columns,
)

RUN = "cols"
CUSTOM = """def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.endswith(ground_truth)), "chars": len(solution_str), **extra_info}
"""
"""A custom function with extra keys: the response's length and its extra_info's (index: null in some rows)."""
MODES = pytest.mark.parametrize(
    "data_min_rows", [None, pytest.param(0, marks=pytest.mark.ray)], ids=["in-process", "ray-data"]
)


def _rollouts(n: int, seed: int = 0, *, null_info: bool = True) -> pd.DataFrame:
    """n rollouts in groups of 4, shuffled (each block is scored in rollout_id order), every column filled
    (extra_info null in every third row with `null_info`: on Ray Data a custom function fails on a null extra_info,
    with or without the column selection, as Ray's pandas batches hold it as pd.NA)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 9, n)
    turn = {"turn_index": 0, "role": "assistant", "token_start": 0, "token_end": 1, "text": "t"}
    return pd.DataFrame(
        {
            "policy_version": 0,
            "rollout_id": np.arange(n),
            "prompt_id": np.arange(n) // 4,
            "group_id": np.arange(n) // 4,
            "sample_index": np.arange(n) % 4,
            "data_source": "openai/gsm8k",
            "ground_truth": [str(i % 5) for i in range(n)],
            "extra_info": [None if null_info and i % 3 == 0 else f'{{"index": {i}}}' for i in range(n)],
            "prompt_text": "q",
            "prompt_token_ids": [list(rng.integers(0, 50, 3)) for _ in range(n)],
            "response_token_ids": [list(rng.integers(0, 50, k)) for k in lengths],
            "rollout_logprobs": [list(-rng.random(k)) for k in lengths],
            "response_mask": [[1] * k if i % 3 == 0 else None for i, k in enumerate(lengths)],
            "response_text": [f"#### {i % 5 if i % 2 else 9}" for i in range(n)],
            "response_length": lengths.astype(np.int32),
            "finish_reason": "stop",
            **{"engine": "hf", "engine_sync": "build", "engine_weights_fingerprint": "f"},
            "gen_round": np.arange(n) % 2,
            "is_baseline": False,
            "turns": [[turn] if i % 4 == 0 else None for i in range(n)],
        }
    ).sample(frac=1.0, random_state=seed)


def _cfgs(tmp_path: Path) -> dict[str, RewardConfig]:
    path = tmp_path / "custom_reward.py"
    path.write_text(CUSTOM)
    overlong = {"enable": True, "len": 4, "penalty_factor": 1.0}
    return {
        "rule": RewardConfig(overlong_buffer=overlong),
        "custom": RewardConfig(custom_reward_function={"path": str(path)}, overlong_buffer=overlong),
    }


def _spoil_token_columns(table: str) -> int:
    """Overwrite every token column chunk of the table's Parquet files with 0xff (same size: the Delta log, the
    footers and the other columns stay valid); returns how many chunks."""
    spoiled = 0
    for f in Path(table).rglob("*.parquet"):
        meta, data = pq.ParquetFile(f).metadata, bytearray(f.read_bytes())
        for rg in range(meta.num_row_groups):
            for i in range(meta.num_columns):
                chunk = meta.row_group(rg).column(i)
                if chunk.path_in_schema.split(".")[0] in ROLLOUT_TOKEN_COLUMNS:
                    start = chunk.dictionary_page_offset or chunk.data_page_offset
                    data[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
                    spoiled += 1
        f.write_bytes(bytes(data))
    return spoiled


def _score_every_column(cfg: RewardConfig, src: str, target: str, *, data_min_rows, then=None) -> int:
    """score_partition as it was before it chose columns: the stage executor reads every rollouts column."""
    sources = stage_exec.read_columns(src, RUN, 0, ["data_source"])["data_source"].unique()
    stage = reward_stage(cfg, sources, max_response_length=8)
    run = stage_exec.run_table_stage(
        ScoreBatch(stage, then), src, target, "scored_rollouts", run_id=RUN, iteration=0, version=None, lineage={},
        data_min_rows=data_min_rows,
    )  # fmt: skip
    return run.version


def _score(cfg: RewardConfig, src: str, target: str, *, data_min_rows, then=None) -> stage_exec.StageRun:
    kw = {"run_id": RUN, "iteration": 0, "version": None, "lineage": {}, "max_response_length": 8}
    return score_partition(cfg, src, target, **kw, data_min_rows=data_min_rows, then=then)


def _same_tables(a: str, b: str, *, ordered: bool = True) -> None:
    """Rows (in the order read; Ray Data writes its blocks in no set order: by rollout_id), values, dtypes, the Delta
    schema and the files' row counts all equal."""
    rows = [store.read_partition(t, RUN, 0) for t in (a, b)]
    if not ordered:
        rows = [r.sort_values("rollout_id", kind="stable").reset_index(drop=True) for r in rows]
    pd.testing.assert_frame_equal(rows[0], rows[1])
    assert store.open_table(a).schema().to_arrow() == store.open_table(b).schema().to_arrow()
    counts = [store.open_table(t).get_add_actions(flatten=True).column("num_records").to_pylist() for t in (a, b)]
    assert sorted(counts[0]) == sorted(counts[1]) and len(counts[0]) > 1 and (not ordered or counts[0] == counts[1])


@MODES
@pytest.mark.parametrize("reward", ["rule", "custom"])
def test_the_scored_table_is_the_one_every_column_gives(tmp_path, monkeypatch, request, data_min_rows, reward):
    if data_min_rows is not None:
        request.getfixturevalue("ray_session")
    monkeypatch.setattr(stage_exec, "BATCH_ROWS", 7)  # in-process: 5 batches, 5 files
    src, local = str(tmp_path / "rollouts"), data_min_rows is None
    store.write_partition(src, "rollouts", _rollouts(30, null_info=local), run_id=RUN, iteration=0, lineage={})
    cfg = _cfgs(tmp_path)[reward]
    run = _score(cfg, src, str(tmp_path / "selected"), data_min_rows=data_min_rows)
    _score_every_column(cfg, src, str(tmp_path / "every"), data_min_rows=data_min_rows)
    assert run.mode == ("local" if local else "ray")
    _same_tables(str(tmp_path / "selected"), str(tmp_path / "every"), ordered=local)
    scored = store.read_partition(str(tmp_path / "selected"), RUN, 0)
    assert not set(ROLLOUT_TOKEN_COLUMNS) & set(scored.columns) and scored["reward_error"].isna().all()
    if reward == "custom":  # the extra keys are columns
        assert {"chars", "index"} <= set(scored.columns) and scored["index"].isna().sum() == (10 if local else 0)


@MODES
def test_the_token_columns_are_never_read(tmp_path, monkeypatch, request, data_min_rows):
    if data_min_rows is not None:
        request.getfixturevalue("ray_session")
    monkeypatch.setattr(stage_exec, "BATCH_ROWS", 7)
    good, bad, local = str(tmp_path / "rollouts"), str(tmp_path / "spoiled"), data_min_rows is None
    for uri in (good, bad):
        store.write_partition(uri, "rollouts", _rollouts(30, null_info=local), run_id=RUN, iteration=0, lineage={})
    assert _spoil_token_columns(bad) >= len(ROLLOUT_TOKEN_COLUMNS)
    for column in ROLLOUT_TOKEN_COLUMNS:  # any read of a token column fails on the spoiled table
        with pytest.raises(OSError):
            stage_exec.read_columns(bad, RUN, 0, [column])
    with pytest.raises(OSError):  # as scoring did when it read every column
        _score_every_column(RewardConfig(), bad, str(tmp_path / "x"), data_min_rows=None)

    cfg = _cfgs(tmp_path)["custom"]
    judged = pd.DataFrame({"rollout_id": np.arange(30), "judge_score": np.arange(30) / 30.0, "judge_error": None})
    judge = ModelScores(RunConfig(), judged)  # a judge's combination reads the scored block, not the rollouts
    assert judge.rollout_columns == ()
    for name, then in (("custom", None), ("judge", judge)):
        dmr = data_min_rows if then is None else None  # with `then` the stage runs in-process
        _score(cfg, good, str(tmp_path / f"{name}_good"), data_min_rows=dmr, then=then)
        _score(cfg, bad, str(tmp_path / f"{name}_bad"), data_min_rows=dmr, then=then)
        _same_tables(str(tmp_path / f"{name}_good"), str(tmp_path / f"{name}_bad"), ordered=local or then is not None)
    judged_scores = store.read_partition(str(tmp_path / "judge_bad"), RUN, 0)
    assert judged_scores["judge_score"].tolist() == (judged_scores["rollout_id"] / 30.0).tolist()


def test_a_combination_that_may_read_the_rollouts_gets_every_column(tmp_path) -> None:
    """A `then` that does not say what it reads gets the whole rows: the spoiled token columns fail it. (A reward
    model's ModelScores says which: tests/stages/test_reward_model.py.)"""
    src = str(tmp_path / "spoiled")
    store.write_partition(src, "rollouts", _rollouts(8), run_id=RUN, iteration=0, lineage={})
    _spoil_token_columns(src)
    with pytest.raises(OSError):
        _score(RewardConfig(), src, str(tmp_path / "x"), data_min_rows=None, then=lambda scored, rows: scored)


def test_older_files_without_a_column_score_as_before(tmp_path, monkeypatch) -> None:
    """A rollouts partition written before the table had gen_round, is_baseline, extra_info and the multi-turn
    columns: a selected column its file lacks stays out of the batch, as before (the write fills its default:
    gen_round 0, not null)."""
    from deltalake import write_deltalake

    monkeypatch.setattr(stage_exec, "BATCH_ROWS", 7)
    src, rollouts = str(tmp_path / "rollouts"), _rollouts(20)
    old = [f for f in SCHEMAS["rollouts"].names if f not in ("gen_round", "is_baseline", "extra_info", "turns")]
    old = [f for f in old if f != "response_mask"]
    table = store.to_arrow("rollouts", rollouts.assign(run_id=RUN, iteration=0)).select(old)
    write_deltalake(src, table, partition_by=["run_id", "iteration"])  # what an older rlake wrote
    store.write_partition(src, "rollouts", rollouts, run_id=RUN, iteration=1, lineage={})  # the schema grows
    assert "gen_round" in stage_exec.Partition(src, RUN, 0, None).columns()
    cfg = _cfgs(tmp_path)["custom"]
    _score(cfg, src, str(tmp_path / "selected"), data_min_rows=None)
    _score_every_column(cfg, src, str(tmp_path / "every"), data_min_rows=None)
    pd.testing.assert_frame_equal(
        store.read_partition(str(tmp_path / "selected"), RUN, 0), store.read_partition(str(tmp_path / "every"), RUN, 0)
    )
    assert store.read_partition(str(tmp_path / "selected"), RUN, 0)["gen_round"].tolist() == [0] * 20


def test_the_scorer_reads_only_scorer_reads(tmp_path) -> None:
    """SCORER_READS is what the rule and custom scorers read: a block of only those columns scores as the whole
    rows do; scored_columns keeps them and drops exactly the token columns."""
    rollouts = _rollouts(24).reset_index(drop=True)
    for cfg in _cfgs(tmp_path).values():
        batch = ScoreBatch(reward_stage(cfg, ["openai/gsm8k"], max_response_length=8))
        whole, few = batch(rollouts), batch(rollouts[list(SCORER_READS)])
        pd.testing.assert_frame_equal(few, whole[list(few.columns)])
    names = [f for f in SCHEMAS["rollouts"].names if f not in ("run_id", "iteration")]
    assert set(SCORER_READS) <= set(scored_columns(names))
    assert set(names) - set(scored_columns(names)) == set(ROLLOUT_TOKEN_COLUMNS)
