"""Small Parquet files read in one request: a Delta table's pyarrow dataset whose filesystem reads a file of at
most WHOLE_FILE_BYTES whole, once, when it is opened.

pyarrow's Parquet reader reads a file in several ranged reads: its footer, then each column chunk (or, pre-buffered,
the coalesced ranges of the projected columns). On S3 each read is one GET, and a tiny or small run's partition
files are a few KB with 10-20 columns: a stage that read the iteration's partitions made ~170 GETs of table data
per iteration on the cluster for a few hundred KB (#37 item 4). Read whole, each file is one GET; files above the
limit keep the ranged reads, so a large partition is still streamed and a read's peak grows by at most the limit per
open file. The files' sizes come from the Delta log (delta-rs's filesystem for the table knows them): no HEAD.

A file read whole is kept in a small process-wide cache (CACHE_BYTES, least recently used out first), keyed by the
table, the file's path and its size: a Delta data file is never rewritten under its name (delta-rs's and rlake's
writers name each file with a new UUID), so a second read of it (a trainer rank reads its shard's keys, then its
rows; the driver's steps read partitions an earlier step of the same iteration read) asks S3 again for
nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pa_fs

WHOLE_FILE_BYTES = 1 << 20
"""Files up to this size are read whole when opened (stage_exec.READ_BUFFER: what a streamed read holds anyway)."""
CACHE_BYTES = 16 << 20
"""The most bytes of whole files a process keeps for a second read."""
_CACHE: OrderedDict[tuple[str, str, int], pa.Buffer] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_HELD = [0]
"""Bytes in _CACHE."""


def _cached(key: tuple[str, str, int]) -> pa.Buffer | None:
    with _CACHE_LOCK:
        buf = _CACHE.get(key)
        if buf is not None:
            _CACHE.move_to_end(key)
        return buf


def _keep(key: tuple[str, str, int], buf: pa.Buffer) -> None:
    with _CACHE_LOCK:
        if key not in _CACHE:
            _HELD[0] += buf.size
        _CACHE[key] = buf
        while _HELD[0] > CACHE_BYTES and _CACHE:
            _HELD[0] -= _CACHE.popitem(last=False)[1].size


def forget_files() -> None:
    """Empty this process's cache of whole files."""
    with _CACHE_LOCK:
        _CACHE.clear()
        _HELD[0] = 0


class WholeSmallFiles(pa_fs.FileSystemHandler):
    """A pyarrow filesystem handler over `base` that opens files of at most `limit` bytes by reading them whole
    (one read of the base filesystem) and serves the reader from memory; everything else is `base`'s. With `table`
    (the table's URI, which `base`'s paths are relative to) the whole files are cached (_CACHE)."""

    def __init__(self, base: pa_fs.FileSystem, limit: int = WHOLE_FILE_BYTES, table: str | None = None) -> None:
        self.base, self.limit, self.table = base, limit, table

    def open_input_file(self, path: str) -> pa.NativeFile:
        f = self.base.open_input_file(path)
        size = f.size()
        if size > self.limit:
            return f
        key = None if self.table is None else (self.table, path, size)
        buf = None if key is None else _cached(key)
        if buf is None:
            with f:
                buf = f.read_buffer()
            if key is not None:
                _keep(key, buf)
        else:
            f.close()
        return pa.BufferReader(buf)

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self.base.open_input_stream(path)

    def get_type_name(self) -> str:
        return f"whole-small-files+{self.base.type_name}"

    def normalize_path(self, path: str) -> str:
        return self.base.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pa_fs.FileInfo]:
        return self.base.get_file_info(paths)

    def get_file_info_selector(self, selector: pa_fs.FileSelector) -> list[pa_fs.FileInfo]:
        return self.base.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.base.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.base.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.base.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.base.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.base.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.base.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.base.copy_file(src, dest)

    def open_output_stream(self, path: str, metadata: dict | None = None) -> pa.NativeFile:
        return self.base.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: dict | None = None) -> pa.NativeFile:
        return self.base.open_append_stream(path, metadata=metadata)

    def __eq__(self, other: object) -> bool:
        same = isinstance(other, WholeSmallFiles) and other.base.equals(self.base)
        return same and (other.limit, other.table) == (self.limit, self.table)

    def __ne__(self, other: object) -> bool:
        return not self == other


def whole_small_files(
    ds: pads.FileSystemDataset, limit: int = WHOLE_FILE_BYTES, table: str | None = None
) -> pads.FileSystemDataset:
    """`ds` (a table's dataset: DeltaTable.to_pyarrow_dataset) with the same fragments, schema and format over a
    filesystem that reads each file of at most `limit` bytes whole (WholeSmallFiles): same rows, fewer requests.
    With `table` (the table's URI) a file read whole once is not read again while the cache holds it."""
    fs = pa_fs.PyFileSystem(WholeSmallFiles(ds.filesystem, limit, table))
    fragments = [
        ds.format.make_fragment(f.path, filesystem=fs, partition_expression=f.partition_expression)
        for f in ds.get_fragments()
    ]
    return pads.FileSystemDataset(fragments, ds.schema, ds.format, fs)
