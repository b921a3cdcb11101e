"""Delta I/O on a real table under tmp_path: partition replace, idempotence, lineage, schema."""

from __future__ import annotations

import pandas as pd
import pytest
from deltalake import DeltaTable

from stages.io import store
from stages.io.tables import SCHEMAS


def _metrics(values: dict[str, float]) -> pd.DataFrame:
    return pd.DataFrame({"policy_version": 1, "metric": list(values), "value": list(values.values())})


def test_partition_write_is_idempotent_and_isolated(tmp_path) -> None:
    uri = str(tmp_path / "iteration_metrics")
    lin = {"stage": "t", "upstream": {"advantages": 3}, "config_hash": "abc", "policy_version": "1"}
    v0 = store.write_partition(
        uri, "iteration_metrics", _metrics({"a": 1.0, "b": 2.0}), run_id="r", iteration=0, lineage=lin
    )
    store.write_partition(uri, "iteration_metrics", _metrics({"a": 5.0}), run_id="r", iteration=1, lineage=lin)
    store.write_partition(uri, "iteration_metrics", _metrics({"a": 7.0}), run_id="other", iteration=0, lineage=lin)
    # a retried write of (r, 0) replaces its rows: no duplicates, other partitions untouched
    v3 = store.write_partition(
        uri, "iteration_metrics", _metrics({"a": 9.0, "b": 2.0}), run_id="r", iteration=0, lineage=lin
    )
    assert (v0, v3) == (0, 3)
    r0 = store.read_partition(uri, "r", 0).sort_values("metric")
    assert r0["value"].tolist() == [9.0, 2.0] and len(r0) == 2
    assert store.read_partition(uri, "r", 1)["value"].tolist() == [5.0]
    assert store.read_partition(uri, "other", 0)["value"].tolist() == [7.0]
    assert store.read_partition(uri, "r", 0, version=v0).sort_values("metric")["value"].tolist() == [
        1.0,
        2.0,
    ]  # time travel
    assert DeltaTable(uri).schema().to_arrow() is not None
    assert len(DeltaTable(uri).to_pandas()) == 4


def test_every_commit_carries_lineage(tmp_path) -> None:
    uri = str(tmp_path / "t")
    lin = {"stage": "advantages", "upstream": {"scored_rollouts": 4}, "config_hash": "abc123", "policy_version": "2"}
    store.write_partition(uri, "iteration_metrics", _metrics({"a": 1.0}), run_id="run-x", iteration=2, lineage=lin)
    (entry,) = store.commit_lineage(uri, run_id="run-x", iteration=2)
    assert entry["run_id"] == "run-x" and entry["iteration"] == "2" and entry["policy_version"] == "2"
    assert entry["config_hash"] == "abc123" and entry["upstream"] == {"scored_rollouts": 4}
    assert entry["code_version"] and entry["table"] == "iteration_metrics" and entry["version"] == 0


def test_schema_is_enforced_and_empty_writes_refused(tmp_path) -> None:
    uri = str(tmp_path / "t")
    with pytest.raises(ValueError, match=r"lacks columns \['policy_version'\]"):
        store.write_partition(
            uri,
            "iteration_metrics",
            pd.DataFrame({"metric": ["a"], "value": [1.0]}),
            run_id="r",
            iteration=0,
            lineage={},
        )
    with pytest.raises(ValueError, match="refusing to write an empty partition"):
        store.write_partition(uri, "iteration_metrics", _metrics({}), run_id="r", iteration=0, lineage={})
    store.write_partition(uri, "iteration_metrics", _metrics({"a": 1.0}), run_id="r", iteration=0, lineage={})
    assert DeltaTable(uri).schema().to_arrow().names == SCHEMAS["iteration_metrics"].names


def test_missing_partition_says_what_to_materialize(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="materialize its asset first"):
        store.read_partition(str(tmp_path / "none"), "r", 0)
    uri = str(tmp_path / "t")
    store.write_partition(uri, "iteration_metrics", _metrics({"a": 1.0}), run_id="r", iteration=0, lineage={})
    with pytest.raises(LookupError, match="no rows for run 'r' iteration 5"):
        store.read_partition(uri, "r", 5)


def test_a_table_from_an_older_schema_gains_new_columns(tmp_path) -> None:
    """A run resumed on a newer rlake writes columns its tables do not have yet: write_partition merges
    the schema (old rows read the new column as null) instead of refusing the write."""
    import pandas as pd
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    uri = str(tmp_path / "iteration_metrics")
    old = pa.table(
        {"run_id": ["r", "r"], "iteration": pa.array([0, 1], pa.int64()), "metric": ["m", "m"], "value": [1.0, 2.0]}
    )  # written before policy_version existed
    write_deltalake(uri, old, mode="append", partition_by=["run_id", "iteration"])
    rows = pd.DataFrame({"policy_version": [2], "metric": ["m"], "value": [5.0]})
    store.write_partition(uri, "iteration_metrics", rows, run_id="r", iteration=1, lineage={"stage": "test"})
    df = DeltaTable(uri).to_pandas().sort_values("iteration")
    assert df["value"].tolist() == [1.0, 5.0] and df["policy_version"].isna().tolist() == [True, False]
