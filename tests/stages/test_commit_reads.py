"""A partition read at a recorded version from that version's commit alone (stages/io/commit_reads.py, #36) gives
what time travel gives: the same rows, columns, column order and dtypes, for whole reads, column subsets and
filters, a re-written partition, a column added by a later partition, both rlake writers (store.write_partition
and dataset_io.commit_files), a run id with a quote; and it steps aside (the delta-rs read runs) whenever the
commit is not exactly the partition: another partition's commit, an OPTIMIZE, an append, a commit file gone, a
schema this process never saw. A vacuumed recorded version still says so. Real Delta tables under tmp_path."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import CommitProperties, DeltaTable, write_deltalake

from stages.io import commit_reads, dataset_io, maintenance, stage_exec, store
from stages.io.tables import SCHEMAS

NAME = "scored_rollouts"


def _rows(n: int, seed: int, extra: str | None = None) -> pd.DataFrame:
    """n rows of scored_rollouts with a value in every column (varied by row and seed); `extra`: a custom reward's
    extra key, a float column the table gains with this write."""

    def value(t: pa.DataType, i: int):
        if pa.types.is_struct(t):
            return None
        if pa.types.is_list(t):
            return [] if pa.types.is_string(t.value_type) else [value(t.value_type, i)] * (i % 3)
        if pa.types.is_string(t):
            return f"s{seed}-{i}"
        return bool(i % 2) if pa.types.is_boolean(t) else i + seed / 10 if pa.types.is_floating(t) else i + seed

    fields = [f for f in SCHEMAS[NAME] if f.name not in ("run_id", "iteration")]
    df = pd.DataFrame([{f.name: value(f.type, i) for f in fields} for i in range(n)])
    df["rollout_id"] = range(n)
    if extra is not None:
        df = df.assign(**{"reward_extra_keys": [[extra]] * n, extra: [0.25 * i for i in range(n)]})
    return df


def _commit_files(uri: str, df: pd.DataFrame, run_id: str, iteration: int) -> int:
    """A partition written as the Ray-block writers do: two files, one commit (dataset_io.commit_files)."""
    blocks = [df.iloc[: len(df) // 2], df.iloc[len(df) // 2 :]]
    kw = {"uri": uri, "options": None, "name": NAME, "run_id": run_id, "iteration": iteration}
    files = pd.concat([dataset_io.write_block(b, **kw) for b in blocks], ignore_index=True)
    return dataset_io.commit_files(
        uri, NAME, files, run_id=run_id, iteration=iteration, lineage={"stage": NAME}, storage_options=None
    )


@pytest.fixture
def lake(tmp_path):
    """The table, and the version each commit wrote: (run_id, iteration) per version."""
    uri, wrote = str(tmp_path / NAME), {}

    def write(run_id: str, iteration: int, df: pd.DataFrame) -> None:
        v = store.write_partition(uri, NAME, df, run_id=run_id, iteration=iteration, lineage={"stage": NAME})
        wrote[v] = (run_id, iteration)

    write("a", 0, _rows(5, 0))
    write("a", 1, _rows(4, 1))
    write("b'q", 0, _rows(3, 2))
    write("a", 1, _rows(6, 3))  # iteration 1 re-written: replaces its 4 rows
    write("a", 2, _rows(5, 4, extra="acc"))  # the table gains column acc
    wrote[_commit_files(uri, _rows(6, 5, extra="acc"), "a", 3)] = ("a", 3)
    write("a", 0, _rows(2, 6))  # an old partition re-written after the schema grew: acc null in its rows
    wrote[_commit_files(uri, _rows(3, 7, extra="acc"), "a", 1)] = ("a", 1)  # re-written by the block writers
    return uri, wrote


def _time_travel(uri: str, run_id: str, iteration: int, version: int, columns, filters) -> pd.DataFrame:
    partition = [("run_id", "=", run_id), ("iteration", "=", str(iteration))]
    return DeltaTable(uri, version=version).to_pandas(partitions=partition, columns=columns, filters=filters)


def _cases(uri: str, version: int):
    names = DeltaTable(uri, version=version).schema().to_arrow().names
    subset = [c for c in ("acc", "reward", "iteration", "rollout_id", "run_id", "reward_extra_keys") if c in names]
    for columns in (None, ["reward", "rollout_id"], subset):
        for filters in (None, pc.field("rollout_id") >= 2):
            yield columns, filters


def test_reads_at_the_writing_commit_equal_time_travel(lake) -> None:
    uri, wrote = lake
    taken = 0
    for version, (run_id, iteration) in wrote.items():
        for columns, filters in _cases(uri, version):
            key = store._key(*store._open(uri, None))
            direct = commit_reads.read_written(uri, key, run_id, iteration, version, columns=columns, filters=filters)
            assert direct is not None, (version, run_id, iteration)  # the shortcut applies: the commit wrote it whole
            want = _time_travel(uri, run_id, iteration, version, columns, filters)
            pd.testing.assert_frame_equal(direct, want)
            got, at = store.read_partition_at(uri, run_id, iteration, version=version, columns=columns, filters=filters)
            assert at == version
            pd.testing.assert_frame_equal(got, want)
            taken += 1
    assert taken == 8 * 6
    assert store.read_partition(uri, "a", 0, version=0)["rollout_id"].tolist() == list(range(5))
    assert "acc" not in store.read_partition(uri, "a", 1, version=3).columns  # before the schema grew
    assert store.read_partition(uri, "a", 0, version=6)["acc"].isna().all()  # after: nulls, as time travel gives
    assert store.present_columns(uri, ["acc", "reward"], version=3) == ["reward"]
    assert store.present_columns(uri, ["acc", "reward"], version=4) == ["acc", "reward"]


def _stage_reads(uri: str, run_id: str, iteration: int, version: int) -> list:
    """What the stage executor reads of a partition at a version (stages/io/stage_exec.py)."""
    part = stage_exec.Partition(uri, run_id, iteration, version)
    batches = [b for b in part.record_batches(["reward", "acc", "rollout_id"], batch_rows=2)]
    return [
        stage_exec.partition_rows(uri, run_id, iteration, version=version),
        part.columns(),
        part.arrow(["rollout_id", "reward"]),
        pa.Table.from_batches(batches).to_pandas() if batches else None,
        pd.concat(list(part.batches(batch_rows=4))),
        part.read(["reward_extra_keys", "response_text", "rollout_id"]),
    ]


def test_stage_reads_at_the_writing_commit_equal_time_travel(lake, monkeypatch) -> None:
    uri, wrote = lake
    direct = {v: _stage_reads(uri, *partition, v) for v, partition in wrote.items()}
    monkeypatch.setattr(commit_reads, "schema_at", lambda *a: None)  # no version known: every read time-travels
    for version, partition in wrote.items():
        for got, want in zip(direct[version], _stage_reads(uri, *partition, version), strict=True):
            if isinstance(want, pd.DataFrame):
                pd.testing.assert_frame_equal(got, want)
            else:
                assert got == want, (version, got, want)


def test_other_commits_fall_back_to_time_travel(lake) -> None:
    uri, wrote = lake
    key = store._key(*store._open(uri, None))
    # a version whose commit wrote another partition: the delta-rs read, same answer
    assert commit_reads.read_written(uri, key, "a", 0, 3) is None
    for version in range(8):
        for run_id, iteration in set(wrote.values()):
            want = _time_travel(uri, run_id, iteration, version, None, None)
            if len(want):  # the partition is there at that version
                pd.testing.assert_frame_equal(store.read_partition(uri, run_id, iteration, version=version), want)
    props = CommitProperties(custom_metadata={"rlake.run_id": "a", "rlake.iteration": "1"})
    more = store.to_arrow(NAME, _rows(2, 9).assign(run_id="a", iteration=1))
    write_deltalake(uri, more, mode="append", commit_properties=props, schema_mode="merge")  # an append: not whole
    store.open_table(uri)  # this process sees version 8 (its schema is remembered)
    assert commit_reads.read_written(uri, key, "a", 1, 8) is None
    pd.testing.assert_frame_equal(
        store.read_partition(uri, "a", 1, version=8), _time_travel(uri, "a", 1, 8, None, None)
    )
    assert len(store.read_partition(uri, "a", 1, version=8)) == 5  # the 3 rows of version 7 and the 2 appended
    DeltaTable(uri).optimize.compact()  # an OPTIMIZE: no rlake lineage, and not a write
    store.open_table(uri)
    assert commit_reads.read_written(uri, key, "a", 1, 9) is None
    assert len(store.read_partition(uri, "a", 1, version=9)) == 5


def test_no_commit_file_or_no_known_schema_falls_back(lake, tmp_path) -> None:
    uri, wrote = lake
    key = store._key(*store._open(uri, None))
    commit_reads._SCHEMAS.clear()  # a new process that never saw version 1
    assert commit_reads.read_written(uri, key, "a", 1, 1) is None
    pd.testing.assert_frame_equal(
        store.read_partition(uri, "a", 1, version=1), _time_travel(uri, "a", 1, 1, None, None)
    )
    store.open_table(uri, version=6)  # a time-travel open: not remembered
    assert commit_reads.read_written(uri, key, "a", 0, 6) is None
    store.open_table(uri)  # the newest (7): remembered
    assert commit_reads.read_written(uri, key, "a", 1, 7) is not None
    store.forget_tables()
    commit_reads._SCHEMAS.clear()
    store.write_partition(uri, NAME, _rows(2, 8), run_id="a", iteration=9, lineage={})  # its own write: remembered
    assert commit_reads.read_written(uri, key, "a", 9, 8) is not None
    log = tmp_path / NAME / "_delta_log" / f"{7:020d}.json"
    log.rename(log.with_suffix(".gone"))  # the commit file is gone: not this way
    assert commit_reads.read_written(uri, key, "a", 1, 7) is None


def test_a_vacuumed_recorded_version_still_says_so(lake, tmp_path) -> None:
    uri, wrote = lake
    gone = store.open_table(uri, version=0).file_uris()[0]  # iteration 0's first file, replaced at version 6
    (tmp_path / NAME / gone.split(f"{NAME}/", 1)[1]).unlink()  # as a VACUUM without the lineage's versions would
    key = store._key(*store._open(uri, None))
    assert commit_reads.read_written(uri, key, "a", 0, 0) is None
    with pytest.raises(maintenance.VacuumedVersionError, match="can no longer be read"):
        store.read_partition(uri, "a", 0, version=0)
