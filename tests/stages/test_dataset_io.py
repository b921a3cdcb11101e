"""Delta partitions as Ray Datasets (stages/io/dataset_io.py) on a real table under tmp_path and a local Ray:
the same rows, schema and lineage as the driver-side store, one commit per write, nothing half-written."""

from __future__ import annotations

import pandas as pd
import pytest
from deltalake import DeltaTable

from stages.io import dataset_io, store

pytestmark = pytest.mark.ray

LINEAGE = {"stage": "t", "upstream": {"rollouts": 3}, "config_hash": "abc", "policy_version": "1"}


def _metrics(n: int, prefix: str = "m") -> pd.DataFrame:
    return pd.DataFrame({"policy_version": 1, "metric": [f"{prefix}{i}" for i in range(n)], "value": range(n)})


def _scored(n: int, *, start: int = 0, extra: dict | None = None, version: str = "f.py:score@aaa") -> pd.DataFrame:
    """n scored_rollouts rows (groups of 4); `extra`: a custom reward's extra key -> one value for every row."""
    ids = range(start, start + n)
    df = pd.DataFrame(
        {
            "policy_version": 0,
            "rollout_id": ids,
            "prompt_id": [i // 4 for i in ids],
            "group_id": [i // 4 for i in ids],
            "sample_index": [i % 4 for i in ids],
            "data_source": "gsm8k",
            "ground_truth": [str(i) for i in ids],
            "extra_info": "{}",
            "prompt_text": "1+1=",
            "prompt_token_ids": [[5, 6, 7]] * n,
            "response_token_ids": [[8] * (1 + i % 5) for i in ids],
            "rollout_logprobs": [[-0.5] * (1 + i % 5) for i in ids],
            "response_mask": None,
            "response_text": [f"#### {i}" for i in ids],
            "response_length": [1 + i % 5 for i in ids],
            "finish_reason": "stop",
            "engine": "hf",
            "engine_sync": "cached",
            "engine_weights_fingerprint": "fp",
            "turns": None,
            "reward": 1.0,
            "reward_fn": "f.score",
            "reward_error": None,
            "score": 1.0,
            "judge_error": None,
            "rm_version": None,
            "overlong_penalty": 0.0,
            "reward_version": version,
            "reward_extra_keys": [sorted(extra or {})] * n,
        }
    )
    return df.assign(**(extra or {}))


def test_a_driver_written_partition_reads_back_as_a_dataset_at_its_version(ray_session, tmp_path) -> None:
    uri = str(tmp_path / "iteration_metrics")
    v0 = store.write_partition(uri, "iteration_metrics", _metrics(3), run_id="r", iteration=0, lineage=LINEAGE)
    store.write_partition(uri, "iteration_metrics", _metrics(2, "n"), run_id="r", iteration=0, lineage=LINEAGE)
    old = dataset_io.read_partition_dataset(uri, "r", 0, version=v0).to_pandas().sort_values("metric")
    expected = store.read_partition(uri, "r", 0, version=v0).sort_values("metric")
    assert old[expected.columns].astype(str).values.tolist() == expected.astype(str).values.tolist()
    newest = dataset_io.read_partition_dataset(uri, "r", 0, columns=["metric"]).to_pandas()
    assert sorted(newest["metric"]) == ["n0", "n1"] and set(newest.columns) == {"metric", "run_id", "iteration"}
    with pytest.raises(LookupError, match="no files for run 'r' iteration 7"):
        dataset_io.read_partition_dataset(uri, "r", 7)


def test_a_dataset_write_is_one_commit_that_replaces_only_its_partition(ray_session, tmp_path) -> None:
    import ray

    uri = str(tmp_path / "iteration_metrics")
    ds = ray.data.from_pandas(_metrics(1000)).repartition(4)  # four blocks: four files, one commit
    v0 = dataset_io.write_partition_dataset(ds, uri, "iteration_metrics", run_id="r", iteration=0, lineage=LINEAGE)
    v1 = store.write_partition(uri, "iteration_metrics", _metrics(5), run_id="r", iteration=1, lineage=LINEAGE)
    v2 = dataset_io.write_partition_dataset(
        ray.data.from_pandas(_metrics(7, "x")), uri, "iteration_metrics", run_id="r", iteration=0, lineage=LINEAGE
    )
    assert (v0, v1, v2) == (0, 1, 2)
    assert len(dataset_io.partition_files(uri, "r", 0, version=v0)) == 4
    assert sorted(store.read_partition(uri, "r", 0)["metric"]) == [f"x{i}" for i in range(7)]
    assert len(store.read_partition(uri, "r", 0, version=v0)) == 1000  # time travel to the first commit
    assert len(store.read_partition(uri, "r", 1)) == 5 and DeltaTable(uri).count() == 12
    # the same lineage keys as a driver-side write, read by the same commit_lineage, plus the writing nodes
    newest, driver = store.commit_lineage(uri, run_id="r")[:2]
    assert {k for k in newest if k not in ("version", "timestamp")} == {
        k for k in driver if k not in ("version", "timestamp")
    } | {"write_nodes"}
    assert newest["write_nodes"] == [ray.get_runtime_context().get_node_id()]  # the one local node
    assert (newest["iteration"], newest["upstream"], newest["stage"]) == ("0", {"rollouts": 3}, "t")


def test_extra_reward_columns_and_reward_versions_are_the_union_of_the_blocks(ray_session, tmp_path) -> None:
    import ray

    uri = str(tmp_path / "scored_rollouts")
    store.write_partition(
        uri, "scored_rollouts", _scored(8, extra={"format_ok": True}), run_id="r", iteration=0, lineage=LINEAGE
    )
    blocks = [_scored(4, extra={"pred": "12"}), _scored(4, start=4, version="f.py:score@bbb")]
    ds = ray.data.from_pandas(blocks)
    dataset_io.write_partition_dataset(ds, uri, "scored_rollouts", run_id="r", iteration=1, lineage=LINEAGE)
    one = store.read_partition(uri, "r", 1).sort_values("rollout_id")
    assert one["pred"].tolist() == ["12"] * 4 + [None] * 4  # a column one block lacks is null in its rows
    assert store.read_partition(uri, "r", 0)["format_ok"].tolist() == [True] * 8  # older partitions keep theirs
    assert store.commit_lineage(uri, run_id="r", iteration=1)[0]["reward_versions"] == [
        "f.py:score@aaa",
        "f.py:score@bbb",
    ]


def test_a_failing_block_leaves_the_partition_as_it_was(ray_session, tmp_path) -> None:
    import ray

    uri = str(tmp_path / "iteration_metrics")
    v0 = store.write_partition(uri, "iteration_metrics", _metrics(3), run_id="r", iteration=0, lineage=LINEAGE)

    def breaks_on_m5(df: pd.DataFrame) -> pd.DataFrame:
        if "m5" in set(df["metric"]):
            raise RuntimeError("a row the stage cannot handle")
        return df

    ds = ray.data.from_pandas([_metrics(4), _metrics(8).iloc[4:]]).map_batches(breaks_on_m5, batch_format="pandas")
    with pytest.raises(Exception, match="a row the stage cannot handle"):
        dataset_io.write_partition_dataset(ds, uri, "iteration_metrics", run_id="r", iteration=0, lineage=LINEAGE)
    assert DeltaTable(uri).version() == v0  # no commit: readers see the old partition, whole
    assert sorted(store.read_partition(uri, "r", 0)["metric"]) == ["m0", "m1", "m2"]
    with pytest.raises(ValueError, match="refusing to write an empty partition"):
        dataset_io.write_partition_dataset(
            ray.data.from_pandas(_metrics(0)), uri, "iteration_metrics", run_id="r", iteration=0, lineage=LINEAGE
        )


def test_both_writers_record_row_counts_and_no_column_statistics(ray_session, tmp_path) -> None:
    # Every commit re-reads every file's statistics (a write's time grew with the run: store.TABLE_CONFIGURATION),
    # so rlake's tables keep numRecords only. 1000 rows in 4 blocks + 5 rows by the driver: counts 1000 and 5.
    import json

    import ray

    uri = str(tmp_path / "iteration_metrics")
    ds = ray.data.from_pandas(_metrics(1000)).repartition(4)
    v0 = dataset_io.write_partition_dataset(ds, uri, "iteration_metrics", run_id="r", iteration=0, lineage=LINEAGE)
    store.write_partition(uri, "iteration_metrics", _metrics(5), run_id="r", iteration=1, lineage=LINEAGE)
    dt = DeltaTable(uri)
    assert dt.metadata().configuration["delta.dataSkippingNumIndexedCols"] == "0"
    log = [json.loads(line) for v in (v0, v0 + 1) for line in open(f"{uri}/_delta_log/{v:020d}.json")]
    stats = [json.loads(e["add"]["stats"]) for e in log if "add" in e]
    assert len(stats) == 5 and all(not s.get("minValues") and not s.get("nullCount") for s in stats)
    assert sorted(s["numRecords"] for s in stats) == [5, 250, 250, 250, 250]
    from stages.io.stage_exec import partition_rows

    assert (partition_rows(uri, "r", 0), partition_rows(uri, "r", 1)) == (1000, 5)
