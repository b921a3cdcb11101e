"""pipelines/dagster_storage.py: the pooled sqlite event log `rlake train`'s DAGSTER_HOME selects keeps
Dagster's files and queries (a home is readable by Dagster's own class), is chosen only when the home names no
storage, and its run watch (the webserver's live view) also follows the write-ahead log."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage

from pipelines.dagster_storage import PooledSqliteEventLogStorage, _WalWatchdog, remember_partition_keys
from pipelines.runner import dagster_home


@dg.asset(partitions_def=dg.StaticPartitionsDefinition(["a", "b"]))
def numbers(context) -> dg.MaterializeResult:
    return dg.MaterializeResult(metadata={"partition": context.partition_key}, data_version=dg.DataVersion("1"))


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    return dagster_home(str(tmp_path))


def test_home_selects_pooled_storage_and_dagster_reads_its_files(home: Path) -> None:
    instance = dg.DagsterInstance.get()
    storage = instance.event_log_storage
    assert isinstance(storage, PooledSqliteEventLogStorage)
    assert storage._base_dir == str(home / "history" / "runs")  # where Dagster's default keeps them
    results = [dg.materialize([numbers], instance=instance, partition_key=k) for k in ("a", "b", "a")]
    assert all(r.success for r in results)
    assert storage._empty is not None  # run databases after the first were copies of an empty one
    assert not list((home / "history" / "runs").glob("*.tmp"))
    records = instance.fetch_materializations(dg.AssetKey("numbers"), limit=10).records
    assert [r.partition_key for r in records] == ["a", "b", "a"]
    # Dagster's own class on the same files sees the same runs and events
    plain = SqliteEventLogStorage(str(home / "history" / "runs"))
    for r in results:
        mine = [e.event_log_entry.dagster_event_type for e in storage.get_records_for_run(r.run_id).records]
        theirs = [e.event_log_entry.dagster_event_type for e in plain.get_records_for_run(r.run_id).records]
        assert mine == theirs and len(mine) > 5
    instance.dispose()


def test_storage_is_chosen_only_when_the_home_names_none(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    own = "storage:\n  sqlite:\n    base_dir: /somewhere\n"
    (home / "dagster.yaml").write_text(own)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    dagster_home(str(tmp_path))
    text = (home / "dagster.yaml").read_text()
    assert text.startswith(own) and "PooledSqliteEventLogStorage" not in text and "telemetry" in text


def test_watch_follows_the_write_ahead_log(home: Path) -> None:
    storage = PooledSqliteEventLogStorage(str(home / "history" / "runs"))
    seen = []
    dog = _WalWatchdog(storage, "r1", lambda *a: seen.append(a), None)
    path = storage.path_for_shard("r1")
    assert dog.patterns == [path, path + "-wal"]
    calls = []
    dog._process_log = lambda: calls.append(1)
    for src in (path, path + "-wal", path + "-shm"):
        dog.on_modified(type("E", (), {"src_path": src})())
    assert calls == [1, 1]


def test_forked_child_opens_its_own_connections(home: Path) -> None:
    storage = PooledSqliteEventLogStorage(str(home / "history" / "runs"))
    parent = storage._engine("index")
    assert storage._engine("index") is parent
    pid = os.fork()
    if pid == 0:  # the child: a new engine, the parent's left open for the parent
        os._exit(0 if storage._engine("index") is not parent else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert storage._engine("index") is parent


def test_home_opened_from_its_directory_and_moved_homes_follow(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    home = dagster_home(str(tmp_path / "a"))
    monkeypatch.delenv("DAGSTER_HOME")  # an instance opened from the directory alone (e.g. a test, a script)
    instance = dg.DagsterInstance.from_config(str(home))
    assert instance.event_log_storage._base_dir == str(home / "history" / "runs")
    assert dg.materialize([numbers], instance=instance, partition_key="a").success
    instance.dispose()
    moved = tmp_path / "b" / "dagster_home"
    moved.parent.mkdir()
    home.rename(moved)
    monkeypatch.setenv("DAGSTER_HOME", str(moved))
    dagster_home(str(tmp_path / "b"))
    text = (moved / "dagster.yaml").read_text()
    assert str(moved / "history" / "runs") in text and str(home) not in text and text.count("event_log_storage") == 1
    moved_instance = dg.DagsterInstance.from_config(str(moved))
    assert len(moved_instance.fetch_materializations(dg.AssetKey("numbers"), limit=5).records) == 1
    moved_instance.dispose()


RUNS = dg.DynamicPartitionsDefinition(name="runs")


@dg.asset(partitions_def=dg.MultiPartitionsDefinition({"run": RUNS, "part": dg.StaticPartitionsDefinition(["0", "1"])}))
def per_run(context) -> dg.MaterializeResult:
    return dg.MaterializeResult(metadata={"partition": str(context.partition_key)})


def test_found_partition_keys_are_not_asked_again(home: Path) -> None:
    """remember_partition_keys (what `rlake train` does to its instance): a dynamic partition key found once is
    answered from memory across steps and runs, a key not found is asked each time, a deletion is seen."""
    instance = dg.DagsterInstance.get()
    asked = []
    storage_has = instance.event_log_storage.has_dynamic_partition
    instance.event_log_storage.has_dynamic_partition = lambda *a: asked.append(a) or storage_has(*a)
    remember_partition_keys(instance)
    assert not instance.has_dynamic_partition("runs", "r1") and not instance.has_dynamic_partition("runs", "r1")
    assert len(asked) == 2  # absent: asked each time
    instance.add_dynamic_partitions("runs", ["r1"])
    key = dg.MultiPartitionKey({"run": "r1", "part": "0"})
    for _ in range(2):
        assert dg.materialize([per_run], instance=instance, partition_key=key).success
    assert len(asked) == 3  # Dagster's checks of the run x part key in both runs: one look-up in all
    instance.delete_dynamic_partition("runs", "r1")
    assert not instance.has_dynamic_partition("runs", "r1") and len(asked) == 4
    instance.dispose()
