"""A run whose set-up fails after preflight passed still has its MLflow run, ended FAILED with the error as tag
rlake.error (issue #35): both inputs below pass preflight, with real files, MLflow on sqlite."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipelines.runner import run_training
from stages.io.tracking import ERROR_TAG

CI = "configs/ci_tiny.yaml"


def _mlflow_run(out: Path, run_id: str):
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], filter_string=f"tags.`rlake.run_id` = '{run_id}'"
    )
    assert len(runs) == 1, f"run {run_id}: {len(runs)} MLflow runs"
    return runs[0]


def test_a_dagster_set_up_failure_ends_the_mlflow_run_failed(tmp_path, monkeypatch) -> None:
    """DAGSTER_HOME's dagster.yaml holds a Postgres password: Dagster's set-up refuses it (preflight does not read
    the instance)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("storage:\n  postgres:\n    postgres_url: postgresql+psycopg2://u:pw@h/db\n")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="holds a password"):
        run_training(CI, [f"trainer.output_dir={out}"], run_id="bad-home", log=lambda s: None)
    run = _mlflow_run(out, "bad-home")
    assert run.info.status == "FAILED"
    assert run.data.tags[ERROR_TAG].startswith("ValueError: ") and "holds a password" in run.data.tags[ERROR_TAG]
    assert run.data.params["trainer.output_dir"] == str(out)  # the config is there as for any run


@pytest.mark.ray
def test_a_warm_start_failure_in_the_set_up_job_ends_the_mlflow_run_failed(
    tmp_path, monkeypatch, tiny_checkpoint, ray_session
) -> None:
    """model.path is a causal-LM checkpoint with its config and tokenizer (preflight reads those) whose weights
    file is missing, as after an interrupted copy: the set-up job's initial_policy fails to load it."""
    ckpt = tmp_path / "policy"
    shutil.copytree(tiny_checkpoint, ckpt)
    weights = [p for p in ckpt.iterdir() if p.suffix in (".safetensors", ".bin")]
    assert weights
    for p in weights:
        p.unlink()
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    overrides = [f"trainer.output_dir={out}", f"model.path={ckpt}"]
    with pytest.raises(Exception) as raised:
        run_training(CI, overrides, run_id="no-weights", log=lambda s: None)
    run = _mlflow_run(out, "no-weights")
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert run.data.tags[ERROR_TAG].startswith(type(raised.value).__name__ + ": "), run.data.tags[ERROR_TAG]
