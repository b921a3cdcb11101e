"""A new sqlite MLflow store copied from a migrated empty one is the store MLflow would have created."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from assets.resources import TrackerResource
from stages.io import mlflow_seed


def _schema(db: Path) -> list[tuple]:
    """Every table and index with its definition's lines sorted: MLflow's migrations write a table's constraints
    in an order that changes from one process to the next (two stores it creates differ in it too)."""
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name").fetchall()
    return [
        (kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines())) for kind, name, sql in rows
    ]


def _default_experiment(db: Path) -> tuple:
    with sqlite3.connect(db) as con:
        return con.execute("SELECT name, artifact_location, lifecycle_stage FROM experiments").fetchall()


@pytest.fixture
def template_dir(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "templates"
    monkeypatch.setenv(mlflow_seed.TEMPLATE_DIR_ENV, str(folder))
    return folder


def test_a_seeded_store_is_the_store_mlflow_creates(tmp_path, template_dir, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    made = tmp_path / "made" / "mlflow.db"
    made.parent.mkdir()
    MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()
    seeded = tmp_path / "seeded" / "mlflow.db"
    assert mlflow_seed.seed_sqlite_store(f"sqlite:///{seeded}")
    assert [p.name for p in template_dir.iterdir()] == [f"{mlflow_seed._head_revision()}.db"]
    assert _schema(seeded) == _schema(made)
    # the Default experiment points where a store created in this directory points, not at the template's
    assert (
        _default_experiment(seeded)
        == _default_experiment(made)
        == [("Default", str(tmp_path / "mlruns" / "0"), "active")]
    )
    assert not list(seeded.parent.glob("*.seed"))  # no copy left behind

    # a second store is copied from the same template; an existing store is never replaced
    other = tmp_path / "other.db"
    assert mlflow_seed.seed_sqlite_store(f"sqlite:///{other}")
    tracker = TrackerResource(tracking_uri=f"sqlite:///{other}", artifact_root=(tmp_path / "art").as_uri())
    run = tracker.run_for("r1", step=0)
    MlflowClient(f"sqlite:///{other}").log_metric(run, "critic/score/mean", 0.5, step=0)
    assert not mlflow_seed.seed_sqlite_store(f"sqlite:///{other}")
    assert MlflowClient(f"sqlite:///{other}").get_metric_history(run, "critic/score/mean")[0].value == 0.5


def test_the_tracker_seeds_a_new_store_and_falls_back_to_mlflow(tmp_path, template_dir, monkeypatch) -> None:
    db = tmp_path / "run" / "mlflow.db"
    TrackerResource(tracking_uri=f"sqlite:///{db}", artifact_root=(tmp_path / "art").as_uri()).run_for("r1")
    assert (template_dir / f"{mlflow_seed._head_revision()}.db").exists()

    # a template directory that cannot be made (a file is in the way): MLflow creates the store as before
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(mlflow_seed.TEMPLATE_DIR_ENV, str(blocker))
    db2 = tmp_path / "run2" / "mlflow.db"
    assert not mlflow_seed.seed_sqlite_store(f"sqlite:///{db2}")
    assert not db2.exists()
    run = TrackerResource(tracking_uri=f"sqlite:///{db2}", artifact_root=(tmp_path / "art").as_uri()).run_for("r2")
    assert MlflowClient(f"sqlite:///{db2}").get_run(run).data.tags["rlake.run_id"] == "r2"


def test_only_sqlite_file_uris_are_seeded() -> None:
    assert mlflow_seed.sqlite_path("sqlite:////tmp/x/mlflow.db") == Path("/tmp/x/mlflow.db")
    assert mlflow_seed.sqlite_path("sqlite:///:memory:") is None
    assert mlflow_seed.sqlite_path("http://127.0.0.1:5000") is None
    assert mlflow_seed.sqlite_path("postgresql://u@127.0.0.1/mlflow") is None
    assert not mlflow_seed.seed_sqlite_store("http://127.0.0.1:5000")
