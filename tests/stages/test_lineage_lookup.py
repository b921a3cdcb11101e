"""Bounded lineage look-ups (#36): store.History reads a table's history newest first in pages and must give
the answers of a full history() read, for recent and old iterations, re-written partitions and other runs."""

from __future__ import annotations

import pandas as pd
import pytest
from deltalake import CommitProperties, DeltaTable, write_deltalake

from assets.resources import _MLFLOW_RUNS, TrackerResource
from stages.io import store
from stages.io.tracking import iteration_lineage

ITERATIONS = 40


def _rows(it: int) -> pd.DataFrame:
    return pd.DataFrame({"policy_version": it, "metric": ["a"], "value": [float(it)]})


def _write(uri: str, run: str, it: int, **lineage) -> int:
    lin = {"stage": "t", "upstream": {}, "duration_s": f"{it / 10:.3f}", **lineage}
    return store.write_partition(uri, "iteration_metrics", _rows(it), run_id=run, iteration=it, lineage=lin)


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> str:
    """ITERATIONS iterations of run r, another run's commits between them, iteration 7 re-written near the end
    (a rescore) and a commit without rlake lineage."""
    uri = str(tmp_path_factory.mktemp("lineage") / "iteration_metrics")
    for it in range(ITERATIONS):
        _write(uri, "r", it)
        if it % 5 == 0:
            _write(uri, "other", it)
    _write(uri, "r", 7, stage="rescore")
    write_deltalake(uri, store.to_arrow("iteration_metrics", _rows(99).assign(run_id="x", iteration=99)), mode="append")
    _write(uri, "r", ITERATIONS)
    return uri


def _full(uri: str) -> list[dict]:
    return store.commit_lineage(uri)  # one unbounded history() read: what every look-up read before #36


@pytest.mark.parametrize("it", [0, 7, 20, ITERATIONS - 1, ITERATIONS, ITERATIONS + 5])
def test_newest_commit_of_a_partition_matches_the_full_history(table, it) -> None:
    expected = [c for c in _full(table) if c["run_id"] == "r" and c["iteration"] == str(it)]
    assert store.newest_commit(table, "r", it) == (expected[0] if expected else None)
    assert store.commit_lineage(table, run_id="r", iteration=it) == expected
    assert store.commit_lineage(table, run_id="r", iteration=it, limit=1) == expected[:1]


def test_every_version_looks_up_as_in_the_full_history(table) -> None:
    full = {c["version"]: c for c in _full(table)}
    history = store.History(table)
    newest = DeltaTable(table).version()
    for v in range(newest + 2):  # every version, the non-rlake commit and one past the newest included
        assert history.commit(v) == full.get(v)
    for v, c in full.items():
        assert store.first_commit_of(table, [newest + 5, v], c["run_id"], int(c["iteration"])) == v
        assert store.first_commit_of(table, [v], c["run_id"], int(c["iteration"]) + 1) is None
    assert store.commit_lineage(table, since_version=newest - 3) == [
        c for c in _full(table) if c["version"] >= newest - 3
    ]


def test_a_recent_commit_reads_one_page_and_an_absent_partition_none(table, monkeypatch) -> None:
    store._COMMITS.clear()  # a new process: no commit read yet
    limits = []
    history = DeltaTable.history
    monkeypatch.setattr(DeltaTable, "history", lambda self, limit=None: limits.append(limit) or history(self, limit))
    assert store.newest_commit(table, "r", ITERATIONS)["iteration"] == str(ITERATIONS)
    assert limits == [store.HISTORY_PAGE]
    limits.clear()
    assert store.newest_commit(table, "r", 1000) is None and limits == []  # no rows: no commit to look for
    assert store.newest_commit(table, "r", 7)["stage"] == "rescore" and limits == []  # in the page read: not again
    assert store.newest_commit(table, "r", 1)["version"] == 2 and limits[-1] > store.HISTORY_PAGE  # v1: other run
    limits.clear()
    assert store.newest_commit(table, "r", 1)["version"] == 2 and limits == []  # every commit read once per process


def test_a_commit_made_since_the_last_look_up_is_read_alone(tmp_path, monkeypatch) -> None:
    uri = str(tmp_path / "t")
    for it in range(3):
        _write(uri, "r", it)
    assert store.newest_commit(uri, "r", 2)["iteration"] == "2"
    v = _write(uri, "r", 3)
    limits = []
    history = DeltaTable.history
    monkeypatch.setattr(DeltaTable, "history", lambda self, limit=None: limits.append(limit) or history(self, limit))
    assert store.newest_commit(uri, "r", 3) == store.commit_lineage(uri)[0] and limits == []  # its file alone
    assert store.newest_commit(uri, "r", 3)["version"] == v


def test_first_commit_of_reads_commit_files_only(tmp_path, monkeypatch) -> None:
    uri = str(tmp_path / "t")
    versions = [_write(uri, "r", it) for it in range(3)]
    write_deltalake(  # another writer's commit: this process's open copy of the table does not know it
        uri, store.to_arrow("iteration_metrics", _rows(3).assign(run_id="r", iteration=3)), mode="append",
        commit_properties=CommitProperties(custom_metadata={"rlake.run_id": "r", "rlake.iteration": "3"}),
    )  # fmt: skip
    late = versions[-1] + 1

    def refuse(*a, **kw):
        raise AssertionError("first_commit_of opened or updated the table")

    monkeypatch.setattr(DeltaTable, "update_incremental", refuse)
    monkeypatch.setattr(store, "History", refuse)
    assert store.first_commit_of(uri, [late + 1, late], "r", 3) == late  # late + 1 is not committed yet
    assert store.first_commit_of(uri, [versions[1], versions[2]], "r", 2) == versions[2]
    assert store.first_commit_of(uri, [versions[0]], "r", 1) is None
    store._COMMITS.clear()
    assert store.first_commit_of(uri, [late + 1], "r", 4) is None  # a missing commit file is not remembered
    write_deltalake(
        uri, store.to_arrow("iteration_metrics", _rows(4).assign(run_id="r", iteration=4)), mode="append",
        commit_properties=CommitProperties(custom_metadata={"rlake.run_id": "r", "rlake.iteration": "4"}),
    )  # fmt: skip
    assert store.first_commit_of(uri, [late + 1], "r", 4) == late + 1  # once it is committed, it is found


def test_commits_made_while_paging_are_left_out(tmp_path) -> None:
    uri = str(tmp_path / "t")
    for it in range(3 * store.HISTORY_PAGE):
        _write(uri, "r", it)
    history = store.History(uri)
    assert history.commit(history.version)["iteration"] == str(3 * store.HISTORY_PAGE - 1)  # the first page
    for it in range(3):
        _write(uri, "late", it)  # land between the pages
    assert [c["version"] for c in history.commits()] == list(range(history.version, -1, -1))
    assert history.commit(2)["iteration"] == "2" and history.commit(history.version + 1) is None


def test_iteration_lineage_of_an_old_iteration_after_a_rescore(tmp_path) -> None:
    tables = tmp_path / "tables"
    for it in range(ITERATIONS):
        sc = store.write_partition(
            str(tables / "scored_rollouts"), "iteration_metrics", _rows(it), run_id="r", iteration=it,
            lineage={"stage": "scored_rollouts", "upstream": {}},
        )  # fmt: skip
        _write(str(tables / "iteration_metrics"), "r", it, upstream={"scored_rollouts": sc})
    rescored = _write(str(tables / "scored_rollouts"), "r", 7, stage="rescore")  # not read by any metrics commit
    entries = {e["uri"].rsplit("/", 1)[-1]: e for e in iteration_lineage(tables, "r", 7)}  # both iteration_metrics
    assert entries["iteration_metrics"]["iteration"] == "7"
    assert entries["scored_rollouts"]["version"] == 7 and entries["scored_rollouts"]["version"] != rescored
    _write(str(tables / "iteration_metrics"), "r", 7, upstream={"scored_rollouts": rescored})  # metrics re-done
    assert [e["version"] for e in iteration_lineage(tables, "r", 7)][0] == rescored  # scored_rollouts: TABLES order
    assert iteration_lineage(tables, "r", ITERATIONS + 1) == []


def test_run_for_searches_mlflow_once_per_process(tmp_path, monkeypatch) -> None:
    tracker = TrackerResource(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art"))
    searches = []
    find = TrackerResource._find
    monkeypatch.setattr(TrackerResource, "_find", lambda self, *a, **kw: searches.append(a) or find(self, *a, **kw))
    mid = tracker.run_for("r", step=0)
    assert [tracker.run_for("r", step=s) for s in range(1, 5)] == [mid] * 4 and len(searches) == 1
    assert tracker._client().get_run(mid).data.tags["rlake.last_step"] == "4"
    tracker.end_run("r", "FINISHED")  # forgets the run: the next run_for searches and reopens it
    assert tracker.run_for("r", step=5) == mid and len(searches) == 3
    assert tracker._client().get_run(mid).info.status == "RUNNING"
    _MLFLOW_RUNS.clear()
