"""store.open_table keeps one open copy of each table per process and brings it up to date incrementally (#36):
it sees commits made by other writers, tells a table deleted and created again at the same path from the old
one, and still opens older versions anew; looking up an open local table lists no _delta_log directory. Real
Delta tables under tmp_path."""

from __future__ import annotations

import shutil

import pandas as pd
import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from stages.io import store

RUN = "c"


def _rows(value: int) -> pd.DataFrame:
    return pd.DataFrame({"policy_version": 1, "metric": ["m"], "value": [float(value)]})


def _write(uri: str, it: int, value: int) -> int:
    return store.write_partition(uri, "iteration_metrics", _rows(value), run_id=RUN, iteration=it, lineage={})


def test_open_table_is_shared_and_sees_other_writers(tmp_path) -> None:
    uri = str(tmp_path / "iteration_metrics")
    assert (_write(uri, 0, 1), _write(uri, 1, 2)) == (0, 1)
    table = store.open_table(uri)
    assert store.open_table(uri) is table and table.version() == 1
    other = pa.table({"run_id": [RUN], "iteration": [2], "policy_version": [1], "metric": ["m"], "value": [3.0]})
    write_deltalake(uri, other, mode="append")  # another writer: not through this process's copy
    assert store.open_table(uri) is table and table.version() == 2
    assert store.read_partition(uri, RUN, 2)["value"].tolist() == [3.0]
    assert store.read_partition(uri, RUN, 0, version=0)["value"].tolist() == [1.0]  # an older version: anew
    assert store.open_table(uri, version=1) is not table and store.open_table(uri).version() == 2


def test_a_table_created_again_at_the_same_path_is_opened_anew(tmp_path) -> None:
    uri = str(tmp_path / "iteration_metrics")
    for it in range(3):
        _write(uri, it, it)
    assert store.open_table(uri).version() == 2
    shutil.rmtree(uri)
    assert _write(uri, 5, 7) == 0  # a new table: its version 0, not the old one's version 3
    assert store.open_table(uri).version() == 0
    assert store.read_partition(uri, RUN, 5)["value"].tolist() == [7.0]


def test_an_open_table_is_opened_anew_after_reopen_after_commits(tmp_path, monkeypatch) -> None:
    """delta-rs replays every commit an open table absorbed on each scan and write: the copy is renewed."""
    monkeypatch.setattr(store, "REOPEN_AFTER", 2)
    uri = str(tmp_path / "iteration_metrics")
    _write(uri, 0, 0)
    first = store.open_table(uri)
    for it in (1, 2):
        _write(uri, it, it)
        assert store.open_table(uri) is first
    _write(uri, 3, 3)  # the third commit since the open
    renewed = store.open_table(uri)
    assert renewed is not first and renewed.version() == 3 and store.open_table(uri) is renewed


def _counting(monkeypatch, name: str) -> list[int]:
    """Count the calls of DeltaTable.<name> from now on (the real method still runs)."""
    calls, real = [0], getattr(DeltaTable, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(DeltaTable, name, counted if name != "is_deltatable" else staticmethod(counted))
    return calls


def test_looking_up_an_open_local_table_lists_no_log(tmp_path, monkeypatch) -> None:
    """is_deltatable and update_incremental list the whole _delta_log (one entry per commit ever made, #36): an open
    table whose first commit file is unchanged exists, and is brought up to date only when its next commit exists."""
    uri = str(tmp_path / "iteration_metrics")
    for it in range(3):
        _write(uri, it, it)
    table = store.open_table(uri)
    exists, updates = _counting(monkeypatch, "is_deltatable"), _counting(monkeypatch, "update_incremental")
    assert store.table_exists(uri) and store.open_table(uri) is table
    assert store.read_partition(uri, RUN, 1)["value"].tolist() == [1.0]
    assert (exists[0], updates[0]) == (0, 0)
    other = pa.table({"run_id": [RUN], "iteration": [3], "policy_version": [1], "metric": ["m"], "value": [3.0]})
    write_deltalake(uri, other, mode="append")  # another writer: its commit file is the copy's next one
    assert store.open_table(uri) is table and table.version() == 3 and updates[0] == 1
    assert store.read_partition(uri, RUN, 3)["value"].tolist() == [3.0]
    assert _write(uri, 4, 4) == 4 and (exists[0], updates[0]) == (0, 1)  # its own write: no look-up either
    shutil.rmtree(uri)
    assert not store.table_exists(uri) and exists[0] == 1  # gone: looked at again
    assert not store.table_exists(str(tmp_path / "never_written"))
