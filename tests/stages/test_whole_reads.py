"""Small Parquet files read whole on open (stages/io/whole_reads.py): the same rows as delta-rs's own read, one read
of the file per open below the limit, the base filesystem's ranged file above it. The requests this saves on S3
are counted by bench/cluster_overhead.py --count-requests (docs/benchmarks.md)."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pa_fs
from deltalake import DeltaTable

from stages.io import store, whole_reads
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


class _Counting(pa_fs.FileSystemHandler):
    """A local filesystem that counts the bytes read through the files it opens (the GETs S3 would serve)."""

    def __init__(self, root: str) -> None:
        self.base, self.root, self.reads = pa_fs.LocalFileSystem(), root, 0

    def open_input_file(self, path: str) -> pa.NativeFile:
        handler, raw = self, open(f"{self.root}/{path}", "rb")  # pyarrow closes it

        class Counted:
            closed = property(lambda self: raw.closed)

            def read(self, n=-1):
                handler.reads += 1
                return raw.read(n)

            def __getattr__(self, name):
                return getattr(raw, name)

        return pa.PythonFile(Counted(), mode="r")

    def get_file_info(self, paths):
        return self.base.get_file_info([f"{self.root}/{p}" for p in paths])

    def get_type_name(self) -> str:
        return "counting"

    def normalize_path(self, path: str) -> str:
        return path

    def __eq__(self, other) -> bool:
        return other is self

    def __ne__(self, other) -> bool:
        return other is not self

    get_file_info_selector = create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = None
    delete_file = move = copy_file = open_input_stream = open_output_stream = open_append_stream = None


def test_a_file_read_whole_is_read_once_per_process_while_the_cache_holds_it(tmp_path, monkeypatch) -> None:
    uri = _table(tmp_path)
    (path,) = DeltaTable(uri).file_uris(partition_filters=[("iteration", "=", "0")])
    rel = path.split(uri, 1)[1].lstrip("/")
    counting = _Counting(uri)
    whole_reads.forget_files()
    first = WholeSmallFiles(pa_fs.PyFileSystem(counting), table=uri).open_input_file(rel).read()
    assert counting.reads == 1
    # a second open, by a new handler (a new dataset, another read of the partition): served from the cache
    again = WholeSmallFiles(pa_fs.PyFileSystem(counting), table=uri).open_input_file(rel).read()
    assert again == first and counting.reads == 1
    # without a table there is no key, so no cache; a cache over its byte budget drops the least recent file
    WholeSmallFiles(pa_fs.PyFileSystem(counting)).open_input_file(rel).read()
    assert counting.reads == 2
    monkeypatch.setattr(whole_reads, "CACHE_BYTES", len(first) - 1)
    whole_reads.forget_files()
    WholeSmallFiles(pa_fs.PyFileSystem(counting), table=uri).open_input_file(rel).read()
    WholeSmallFiles(pa_fs.PyFileSystem(counting), table=uri).open_input_file(rel).read()
    assert counting.reads == 4 and not whole_reads._CACHE
    # the store's reads take the cache: the same rows again, the file not read again
    monkeypatch.setattr(whole_reads, "CACHE_BYTES", 16 << 20)
    a = store.read_partition(uri, "r", 0)
    held = dict(whole_reads._CACHE)
    assert len(held) == 1 and next(iter(held))[0] == DeltaTable(uri).table_uri
    pd.testing.assert_frame_equal(store.read_partition(uri, "r", 0), a)
    assert dict(whole_reads._CACHE) == held
