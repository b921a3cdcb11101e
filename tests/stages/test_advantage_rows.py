"""The rows the update ranks, the critic and iteration_metrics read of an advantages partition are the same whether
the partition holds copies of the token and log-prob columns (written before #36) or joins them by rollout_id from
the rollouts / old_logprobs / ref_logprobs / teacher_logprobs partitions its commit read (stages/io/advantage_rows.py).
Real Delta tables under tmp_path; the advantages table holds no joined column."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from configs.schema import ActorConfig, CriticConfig, RolloutCorrectionConfig
from stages.io import store
from stages.io.advantage_rows import JOINED, JoinedAdvantages, read_advantage_rows
from stages.io.stage_exec import Partition
from stages.workers.actor_worker import ROW_COLUMNS, rank_partition, read_rows
from stages.workers.critic_worker import ADVANTAGE_COLUMNS
from stages.workers.requests import CriticUpdateRequest, UpdateRequest

sys.path.insert(0, str(Path(__file__).parent))
from test_advantage_stream import CASES, RUN, _cfg, _stream, _upstream, _whole_frame_table


def _request(uri: str, version: int, world: int) -> UpdateRequest:
    return UpdateRequest(
        run_id=RUN,
        iteration=1,
        advantages_uri=uri,
        advantages_version=version,
        policy_dir="unused",
        out_dir="unused",
        actor=ActorConfig(ppo_mini_batch_size=2, num_workers=world),
        n_per_prompt=4,
        seed=0,
        rollout_correction=RolloutCorrectionConfig(rollout_is="token"),
    )


def _legacy(tmp_path, cfg, up) -> tuple[str, int]:
    """The table the stage wrote before #36 (copies of the joined columns), written as it was."""
    _whole_frame_table(tmp_path, cfg, up)
    uri = str(tmp_path / "whole")
    assert set(JOINED) <= set(Partition(uri, RUN, 1, None).columns())
    return uri, store.table_version(uri)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert list(a.columns) == list(b.columns)
    for column in b.columns:  # repr: exact floats, NaN == NaN, list against list
        assert [repr(np.asarray(v).tolist()) for v in a[column]] == [repr(np.asarray(v).tolist()) for v in b[column]]


@pytest.mark.parametrize("case", ["grpo", "gae_kl_in_reward", "grpo_distill"])
def test_ranks_read_the_rows_of_the_old_layout(tmp_path, case) -> None:
    cfg = _cfg(CASES[case])
    up = _upstream(tmp_path, cfg.algorithm, in_order=True)
    old_uri, old_version = _legacy(tmp_path, cfg, up)
    new_uri = str(tmp_path / "advantages")
    # the table also holds a partition of the old layout: its schema keeps the copies (null in the new files)
    store.write_partition(new_uri, "advantages", store.read_partition(old_uri, RUN, 1), run_id=RUN, iteration=0,
                          lineage={})  # fmt: skip
    version = _stream(cfg, up, tmp_path, batch_rows=5).version
    files = [f for f in store.open_table(new_uri).file_uris() if "iteration=1" in f]
    assert files and not any(set(JOINED) & set(pq.read_schema(f).names) for f in files)  # the table's schema may
    for world in (1, 2, 3):
        for rank in range(world):
            new = rank_partition(_request(new_uri, version, world), rank, world)
            old = rank_partition(_request(old_uri, old_version, world), rank, world)
            assert list(new.columns) == list(ROW_COLUMNS)
            _same(new, old)
            a, b = (
                read_rows(_request(new_uri, version, world), rank, world),
                read_rows(_request(old_uri, old_version, world), rank, world),
            )
            assert a.keys() == b.keys() and "old_logprobs" in a and "rollout_logprobs" in a
            for key in a:
                assert repr(np.asarray(a[key], dtype=object).tolist()) == repr(
                    np.asarray(b[key], dtype=object).tolist()
                )
    _same(
        read_advantage_rows(new_uri, RUN, 1, version, [*ADVANTAGE_COLUMNS, "teacher_logprobs"]),
        read_advantage_rows(old_uri, RUN, 1, old_version, [*ADVANTAGE_COLUMNS, "teacher_logprobs"]),
    )
    streamed = JoinedAdvantages.of(Partition(new_uri, RUN, 1, version)).read()
    _same(streamed, JoinedAdvantages.of(Partition(old_uri, RUN, 1, old_version)).read()[list(streamed.columns)])
    legacy = JoinedAdvantages.of(Partition(new_uri, RUN, 0, None))  # the old-layout partition: its copies, as they are
    assert legacy.sources is None and set(JOINED) <= set(legacy.columns())


def test_critic_rank_reads_the_rows_of_the_old_layout(tmp_path) -> None:
    from stages.workers.critic_worker import critic_rows

    cfg = _cfg(CASES["gae"])
    up = _upstream(tmp_path, cfg.algorithm)
    old_uri, old_version = _legacy(tmp_path, cfg, up)
    version = _stream(cfg, up, tmp_path).version

    def req(uri, v):
        return CriticUpdateRequest(1, "c", "o", CriticConfig(), 4, 0, RUN, uri, v, up.values.uri, up.values.version)

    a, b = critic_rows(req(str(tmp_path / "advantages"), version)), critic_rows(req(old_uri, old_version))
    assert a.keys() == b.keys()
    for key in a:
        assert repr(np.asarray(a[key], dtype=object).tolist()) == repr(np.asarray(b[key], dtype=object).tolist())


def test_a_joined_row_missing_from_its_table_is_an_error(tmp_path) -> None:
    cfg = _cfg(CASES["grpo"])
    up = _upstream(tmp_path, cfg.algorithm)
    version = _stream(cfg, up, tmp_path).version
    old = store.read_partition(up.old.uri, RUN, 1)
    store.write_partition(up.old.uri, "old_logprobs", old[old["rollout_id"] != 3], run_id=RUN, iteration=1, lineage={})
    # the recorded version is still there: the rows read are the ones the stage read
    rows = read_advantage_rows(str(tmp_path / "advantages"), RUN, 1, version, ["rollout_id", "old_logprobs"])
    assert 3 in rows["rollout_id"].tolist()
    with pytest.raises(ValueError, match="lineage records no version"):
        store.write_partition(str(tmp_path / "advantages"), "advantages", rows.drop(columns="old_logprobs").assign(
            group_id=0, policy_version=0, reward=0.0, advantage=0.0, token_advantages=[[]] * len(rows),
            adv_estimator="grpo"), run_id=RUN, iteration=1, lineage={"joins": ["rollouts"]})  # fmt: skip
        read_advantage_rows(str(tmp_path / "advantages"), RUN, 1, None, ["prompt_token_ids"])
