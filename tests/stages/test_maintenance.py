"""Table maintenance on real Delta tables under tmp_path: compaction keeps rows and time travel, VACUUM keeps the
lineage's versions, and a vacuumed recorded version is a clear error (stages/io/maintenance.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, write_deltalake

from pipelines.cli import main
from stages.io import maintenance, store
from stages.io.maintenance import VacuumedVersionError, check_version_files, maintain_tables

BLOCKS = 4  # appends per partition: one small file each, as a partition written from several Ray blocks


def _commit(uri: str, iteration: int, block: int, upstream: dict[str, int]) -> int:
    """One small append to partition ("r", iteration) with rlake lineage metadata; returns the new version."""
    rows = pa.table(
        {
            "run_id": ["r"] * 3,
            "iteration": pa.array([iteration] * 3, pa.int64()),
            "x": pa.array([100 * iteration + 10 * block + k for k in range(3)], pa.int64()),
        }
    )
    meta = {"rlake.run_id": "r", "rlake.iteration": str(iteration), "rlake.upstream": json.dumps(upstream)}
    write_deltalake(
        uri, rows, mode="append", partition_by=["run_id", "iteration"], commit_properties=CommitProperties(meta)
    )
    return DeltaTable(uri).version()


@pytest.fixture
def lake(tmp_path) -> dict:
    """Tables `rollouts` (2 partitions x BLOCKS appends) and `scored_rollouts` (one append per iteration, its
    lineage recording the rollouts version it read); returns the root and the recorded rollouts versions."""
    root = tmp_path / "tables"
    recorded = {}
    for it in (0, 1):
        for block in range(BLOCKS):
            recorded[it] = _commit(str(root / "rollouts"), it, block, {})
        _commit(str(root / "scored_rollouts"), it, 0, {"rollouts": recorded[it]})
    return {"root": str(root), "rollouts": str(root / "rollouts"), "recorded": recorded}


def _rows(uri: str, version: int | None = None, iteration: int | None = None) -> list[int]:
    df = store.open_table(uri, version=version).to_pandas()
    return sorted(df[df.iteration == iteration].x if iteration is not None else df.x)


def test_compaction_keeps_rows_time_travel_and_checkpoints(lake) -> None:
    before = {it: _rows(lake["rollouts"], v, it) for it, v in lake["recorded"].items()}
    latest = _rows(lake["rollouts"])
    reports = {r.table: r for r in maintain_tables(lake["root"], vacuum_retention_hours=None)}
    rollouts = reports["rollouts"]
    assert (rollouts.files_before, rollouts.files_after, rollouts.compacted_files) == (2 * BLOCKS, 2, 2 * BLOCKS)
    assert rollouts.version_after == rollouts.version_before + 1 == rollouts.checkpoint_version
    assert reports["scored_rollouts"].files_after == 2  # one file per partition: nothing to compact
    assert _rows(lake["rollouts"]) == latest  # same rows, fewer files
    for it, version in lake["recorded"].items():  # the recorded versions still read their own (small) files
        assert _rows(lake["rollouts"], version, it) == before[it]
        check_version_files(lake["rollouts"], version, run_id="r", iteration=it)
    assert (store.uris.local_path(lake["rollouts"]) / "_delta_log" / "_last_checkpoint").exists()


def test_lineage_versions_are_own_and_upstream_versions(lake) -> None:
    keep = maintenance.lineage_versions(lake["root"], ["rollouts", "scored_rollouts"])
    assert keep["rollouts"] == set(range(2 * BLOCKS))  # every rlake commit (the recorded ones among them)
    assert set(lake["recorded"].values()) <= keep["rollouts"] and keep["scored_rollouts"] == {0, 1}


def test_vacuum_keeps_lineage_versions_and_removes_orphans(lake) -> None:
    orphan = store.uris.local_path(lake["rollouts"]) / "run_id=r" / "iteration=0" / "part-orphan.parquet"
    orphan.write_bytes(b"a failed write's file")  # no commit names it
    maintain_tables(lake["root"], checkpoint=False, vacuum_retention_hours=None)  # compact first
    reports = maintain_tables(
        lake["root"], tables=["rollouts"], compact=False, vacuum_retention_hours=0, enforce_retention_duration=False
    )
    assert reports[0].vacuumed_files == 1 and not orphan.exists()
    for it, version in lake["recorded"].items():
        check_version_files(lake["rollouts"], version, run_id="r", iteration=it)
        assert len(_rows(lake["rollouts"], version, it)) == 3 * BLOCKS


def test_vacuum_past_a_recorded_version_is_a_clear_error(lake) -> None:
    maintain_tables(lake["root"], vacuum_retention_hours=None)
    dry = maintain_tables(
        lake["root"], compact=False, vacuum_retention_hours=0, keep_lineage=False, enforce_retention_duration=False,
        dry_run=True,
    )  # fmt: skip
    assert dry[0].vacuumed_files == 2 * BLOCKS and dry[0].files_after == dry[0].files_before == 2
    check_version_files(lake["rollouts"], lake["recorded"][0], run_id="r", iteration=0)  # dry run deleted nothing
    report = maintain_tables(
        lake["root"], tables=["rollouts"], compact=False, vacuum_retention_hours=0, keep_lineage=False,
        enforce_retention_duration=False,
    )[0]  # fmt: skip
    assert (report.vacuumed_files, report.kept_versions) == (2 * BLOCKS, 0)
    with pytest.raises(VacuumedVersionError, match=r"'rollouts' version 3 \(run 'r' iteration 0\).*VACUUM.*Fix"):
        check_version_files(lake["rollouts"], lake["recorded"][0], run_id="r", iteration=0)
    with pytest.raises(FileNotFoundError):  # what delta-rs says when the version is read
        _rows(lake["rollouts"], lake["recorded"][0])
    assert len(_rows(lake["rollouts"])) == 2 * 3 * BLOCKS  # the newest version reads the compacted files
    check_version_files(lake["rollouts"], store.table_version(lake["rollouts"]))


def test_rlake_maintain_cli(lake, capsys) -> None:
    assert main(["maintain", "--tables", lake["root"], "--dry-run"]) == 0
    assert "(dry run) rollouts: files 8 -> 8" in capsys.readouterr().out
    assert main(["maintain", "--tables", lake["root"], "--table", "rollouts", "--vacuum-hours", "0"]) == 2
    assert "retention" in capsys.readouterr().err.lower()  # under 7 days needs --allow-short-retention
    args = ["maintain", "--tables", lake["root"], "--vacuum-hours", "0", "--allow-short-retention", "--run-id", "r"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "rollouts: files 8 -> 2" in out and "scored_rollouts: files 2 -> 2" in out
    assert main(["maintain", "--tables", lake["root"], "--table", "nope"]) == 2
    assert "no Delta tables ['nope']" in capsys.readouterr().err
    assert main(["maintain", "--tables", str(Path(lake["root"]).parent)]) == 2
    assert "no Delta tables under" in capsys.readouterr().err


def test_lake_maintenance_job(lake) -> None:
    from assets.resources import RolloutStoreResource
    from pipelines.maintenance import LAKE_MAINTENANCE_JOB, lake_maintenance, lake_maintenance_schedule

    result = lake_maintenance.execute_in_process(
        run_config={"ops": {"maintain_lake": {"config": {"vacuum": False}}}},
        resources={"rollout_store": RolloutStoreResource(root=lake["root"])},
    )
    assert result.success and lake_maintenance.name == LAKE_MAINTENANCE_JOB
    reports = {r["table"]: r for r in result.output_for_node("maintain_lake")}
    assert (reports["rollouts"]["files_before"], reports["rollouts"]["files_after"]) == (2 * BLOCKS, 2)
    assert lake_maintenance_schedule.default_status.value == "STOPPED"  # turned on by hand only


def test_commit_log_is_never_expired_so_old_lineage_stays(tmp_path):
    # delta-rs deletes commits older than delta.logRetentionDuration whenever it writes its automatic checkpoint
    # (every 100 commits). With a 0 s retention, 105 appends would leave 6 commits (99..104) of history; rlake's
    # tables set delta.enableExpiredLogCleanup=false, so all 105 commits (and their lineage) stay.
    uri = str(tmp_path / "iteration_metrics")
    for it in range(105):
        row = pd.DataFrame({"policy_version": [it], "metric": ["m"], "value": [float(it)]})
        store.write_partition(uri, "iteration_metrics", row, run_id="r", iteration=it, lineage={})
        if it == 0:
            DeltaTable(uri).alter.set_table_properties({"delta.logRetentionDuration": "interval 0 seconds"})
    assert len(DeltaTable(uri).history()) == 106  # 105 writes + the property change
    assert store.read_partition(uri, "r", 0, version=0)["value"].tolist() == [0.0]


def test_maintain_sets_the_log_property_on_an_older_table(tmp_path):
    uri = str(tmp_path / "old")
    write_deltalake(uri, pa.table({"run_id": ["r"], "iteration": [0], "x": [1]}), partition_by=["run_id", "iteration"])
    assert "delta.enableExpiredLogCleanup" not in DeltaTable(uri).metadata().configuration
    maintain_tables(str(tmp_path), tables=["old"], vacuum_retention_hours=None)
    config = DeltaTable(uri).metadata().configuration
    assert {k: config.get(k) for k in store.TABLE_CONFIGURATION} == store.TABLE_CONFIGURATION
    # a user's own tuning stays; the log's expiry is turned off again whatever the table says
    props = {"delta.checkpointInterval": "50", "delta.enableExpiredLogCleanup": "true"}
    DeltaTable(uri).alter.set_table_properties(props)
    maintain_tables(str(tmp_path), tables=["old"], vacuum_retention_hours=None)
    config = DeltaTable(uri).metadata().configuration
    assert config["delta.checkpointInterval"] == "50" and config["delta.enableExpiredLogCleanup"] == "false"


def test_reading_a_vacuumed_recorded_version_says_what_and_how_to_fix(tmp_path):
    uri = str(tmp_path / "iteration_metrics")
    for value in (1.0, 2.0):  # v0, then v1 replaces the partition
        row = pd.DataFrame({"policy_version": [0], "metric": ["m"], "value": [value]})
        store.write_partition(uri, "iteration_metrics", row, run_id="r", iteration=0, lineage={})
    for f in DeltaTable(uri, version=0).file_uris():  # what a VACUUM without lineage would remove
        Path(f.removeprefix("file://")).unlink()
    with pytest.raises(VacuumedVersionError):
        store.read_partition(uri, "r", 0, version=0)
    assert store.read_partition(uri, "r", 0)["value"].tolist() == [2.0]


def test_maintain_prunes_older_checkpoints_and_every_version_still_reads(tmp_path, monkeypatch):
    # A checkpoint every 2 commits (delta-rs writes one after versions 1, 3, 5, ...); maintenance keeps the newest
    # of each span of KEEP_CHECKPOINT_EVERY (4 here) versions: 3 (of 0-3), 7 (of 4-7) and 11 (of 8-11).
    monkeypatch.setattr(maintenance, "KEEP_CHECKPOINT_EVERY", 4)
    monkeypatch.setitem(store.TABLE_CONFIGURATION, "delta.checkpointInterval", "2")
    uri = str(tmp_path / "iteration_metrics")
    row = pd.DataFrame({"policy_version": [0], "metric": ["m"], "value": [0.0]})
    for it in range(12):  # v0..v11
        rows = row.assign(value=float(it))
        store.write_partition(uri, "iteration_metrics", rows, run_id="r", iteration=it, lineage={})
    expected = {v: sorted(DeltaTable(uri, version=v).to_pandas()["value"]) for v in range(12)}
    log = Path(uri) / "_delta_log"

    def checkpoints() -> list[int]:
        return sorted(int(p.name[:20]) for p in log.glob("*.checkpoint*.parquet"))

    assert checkpoints() == [1, 3, 5, 7, 9, 11]
    assert maintenance.prune_checkpoints(uri, dry_run=True) == 3 and len(checkpoints()) == 6
    (report,) = maintain_tables(str(tmp_path), tables=["iteration_metrics"], vacuum_retention_hours=None)
    assert report.checkpoint_version == 11 and report.pruned_checkpoints == 3  # 1, 5, 9
    assert checkpoints() == [3, 7, 11]
    assert len(list(log.glob("*.json"))) == 12  # every commit stays: the lineage
    store.forget_tables()
    for v, values in expected.items():  # each version opens from the checkpoint kept before it, or from the start
        assert sorted(DeltaTable(uri, version=v).to_pandas()["value"]) == values
