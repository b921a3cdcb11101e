"""Small Parquet files read whole on open (stages/io/whole_reads.py): the same rows as delta-rs's own read, one read
of the file per open below the limit, the base filesystem's ranged file above it. The requests this saves on S3
are counted by bench/cluster_overhead.py --count-requests (docs/benchmarks.md)."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from stages.io import store
from stages.io.whole_reads import WholeSmallFiles, whole_small_files


def _metrics(n: int) -> pd.DataFrame:
    return pd.DataFrame(
        {"policy_version": 1, "metric": [f"m{i}" for i in range(n)], "value": [float(i) for i in range(n)]}
    )


def _table(tmp_path) -> str:
    uri = str(tmp_path / "iteration_metrics")
    lin = {"stage": "t", "upstream": {}, "config_hash": "abc", "policy_version": "1"}
    store.write_partition(uri, "iteration_metrics", _metrics(3), run_id="r", iteration=0, lineage=lin)
    store.write_partition(uri, "iteration_metrics", _metrics(20_000), run_id="r", iteration=1, lineage=lin)
    return uri


def test_reads_equal_delta_rs_and_only_small_files_are_held_whole(tmp_path) -> None:
    uri = _table(tmp_path)
    dt = DeltaTable(uri)
    for it in (0, 1):
        ds = dt.to_pyarrow_dataset(partitions=[("run_id", "=", "r"), ("iteration", "=", str(it))])
        whole = whole_small_files(ds)
        assert whole.schema == ds.schema and len(list(whole.get_fragments())) == len(list(ds.get_fragments())) == 1
        want = ds.to_table(columns=["metric", "value"], filter=pc.field("value") >= 1.0)
        assert whole.to_table(columns=["metric", "value"], filter=pc.field("value") >= 1.0).equals(want)
    # the store's read of the newest version (its dataset over the same files, filtered): the frames delta-rs reads
    for it in (0, 1):
        expr = pc.field("value") < 2.0
        got = store.read_partition(uri, "r", it, columns=["metric", "value"], filters=expr)
        part = [("run_id", "=", "r"), ("iteration", "=", str(it))]
        pd.testing.assert_frame_equal(got, dt.to_pandas(partitions=part, columns=["metric", "value"], filters=expr))
    # the 3-row file (a few hundred bytes) is opened as one in-memory buffer; with a limit below its size it is not
    ds = dt.to_pyarrow_dataset(partitions=[("run_id", "=", "r"), ("iteration", "=", "0")])
    (path,) = [f.path for f in ds.get_fragments()]
    size = ds.filesystem.open_input_file(path).size()
    small = WholeSmallFiles(ds.filesystem).open_input_file(path)
    assert isinstance(small, pa.BufferReader) and small.size() == size
    assert not isinstance(WholeSmallFiles(ds.filesystem, limit=size - 1).open_input_file(path), pa.BufferReader)
