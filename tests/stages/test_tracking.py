"""MLflow run status, Delta lineage as dataset inputs, validation samples and curves, `rlake plot`:
a real MLflow sqlite store and real Delta tables under tmp_path, no training."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from assets.resources import TrackerResource
from pipelines.cli import main
from stages.io import store
from stages.io.plots import load_run_metrics, validation_rewards
from stages.io.tables import SCHEMAS
from stages.io.tracking import git_commit, iteration_lineage

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VAL = "val-core/rlake/arith/reward/mean@1"
AUX = "val-aux/rlake/arith/reward/mean@4"


def _tracker(tmp_path: Path) -> TrackerResource:
    return TrackerResource(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        experiment_name="rlake-test",
        artifact_root=(tmp_path / "art").as_uri(),
    )


def _row(table: str, **values) -> pd.DataFrame:
    """One schema-conforming row of `table` (nulls except the non-nullable keys)."""
    row = {f.name: (0 if not f.nullable else None) for f in SCHEMAS[table] if f.name not in ("run_id", "iteration")}
    return pd.DataFrame([row | values])


def _write(tables: Path, table: str, it: int, upstream: dict[str, int], df: pd.DataFrame | None = None) -> int:
    lineage = {"stage": table, "policy_version": str(max(it, 0)), "upstream": upstream, "duration_s": "0.1"}
    return store.write_partition(
        str(tables / table), table, _row(table) if df is None else df, run_id="r", iteration=it, lineage=lineage
    )


def _metrics(it: int, values: dict[str, float]) -> pd.DataFrame:
    return pd.DataFrame({"policy_version": it + 1, "metric": list(values), "value": list(values.values())})


@pytest.fixture
def tables(tmp_path) -> Path:
    """Run 'r': prompts + v0 validation (iteration -1), iterations 0 and 1 of a GRPO chain; iteration 0's
    scored_rollouts re-written after its iteration_metrics read the first version."""
    t = tmp_path / "tables"
    p = _write(t, "prompts", -1, {})
    _write(t, "iteration_metrics", -1, {"prompts": p}, _metrics(-1, {VAL: 0.1, AUX: 0.05}))
    for it in (0, 1):
        pb = _write(t, "prompt_batches", it, {"prompts": p})
        ro = _write(t, "rollouts", it, {"prompt_batches": pb})
        sc = _write(t, "scored_rollouts", it, {"rollouts": ro})
        ad = _write(t, "advantages", it, {"scored_rollouts": sc})
        m = {
            "critic/score/mean": 0.2 + 0.1 * it,
            "response_length/mean": 8.0 - it,
            "actor/ppo_kl": 0.01 * it,
            "actor/entropy": 2.0 - 0.1 * it,
            VAL: 0.3 + 0.1 * it,
            AUX: 0.2 + 0.1 * it,
        }
        _write(t, "iteration_metrics", it, {"scored_rollouts": sc, "advantages": ad}, _metrics(it, m))
        if it == 0:
            _write(t, "scored_rollouts", 0, {"rollouts": ro})  # a re-score no one read yet
    return t


def _versions(tables: Path, table: str, it: int) -> list[int]:
    return [c["version"] for c in store.commit_lineage(str(tables / table), run_id="r", iteration=it)]


def test_end_run_sets_the_status_and_a_new_step_reopens(tmp_path) -> None:
    tracker = _tracker(tmp_path)
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    assert tracker.end_run("r", "FAILED") is None  # never logged: nothing to end (and no experiment made)
    mid = tracker.run_for("r", step=0)
    tracker.log_metrics(mid, {"a": 1.0}, step=0)
    status = lambda: client.get_run(mid).info.status  # noqa: E731
    assert status() == "RUNNING"
    assert tracker.end_run("r", "FINISHED") == mid and status() == "FINISHED"
    assert client.get_run(mid).info.end_time is not None
    assert tracker.run_for("r", step=0) == mid and status() == "FINISHED"  # an already-logged step: no reopen
    assert tracker.run_for("r", step=1) == mid and status() == "RUNNING"  # a resumed run logs a new step
    tracker.end_run("r", "FAILED", error="OSError: no weights")
    assert status() == "FAILED" and client.get_run(mid).data.tags["rlake.error"] == "OSError: no weights"
    tracker.run_for("r")  # no step given: any log reopens
    assert status() == "RUNNING"
    tracker.end_run("r", "KILLED")
    assert status() == "KILLED" and client.get_run(mid).data.tags["rlake.last_step"] == "1"
    tracker.end_run("r", "FINISHED")  # the resumed run finished: the earlier error is not its end any more
    assert "rlake.error" not in client.get_run(mid).data.tags
    with pytest.raises(ValueError, match="RUNNING.*Valid: \\['FINISHED', 'FAILED', 'KILLED'\\]"):
        tracker.end_run("r", "RUNNING")


def test_git_commit_tags_the_run(tmp_path) -> None:
    tracker = _tracker(tmp_path)
    tags = MlflowClient(tracking_uri=tracker.tracking_uri).get_run(tracker.run_for("r")).data.tags
    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:  # not a git checkout: no tag, no failure
        assert git_commit() is None and "rlake.git_commit" not in tags
        return
    assert tags["rlake.git_commit"] == tags["mlflow.source.git.commit"] == head.stdout.strip()


def test_iteration_lineage_follows_the_versions_read(tables) -> None:
    by_table = {e["table"]: e for e in iteration_lineage(tables, "r", 0)}
    assert list(by_table) == ["prompt_batches", "rollouts", "scored_rollouts", "advantages", "iteration_metrics"]
    newest, read = _versions(tables, "scored_rollouts", 0)[:2]
    assert newest > read and by_table["scored_rollouts"]["version"] == read  # what iteration_metrics read
    assert by_table["advantages"]["upstream"] == {"scored_rollouts": read}
    v0 = {e["table"]: e["version"] for e in iteration_lineage(tables, "r", -1)}
    assert v0 == {"prompts": 0, "iteration_metrics": 0}


def test_dataset_inputs_carry_table_uri_version_and_context(tables, tmp_path) -> None:
    tracker = _tracker(tmp_path)
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    mid = tracker.run_for("r", step=0)
    for it in (-1, 0, 0):  # logging an iteration twice adds nothing
        metrics_version = _versions(tables, "iteration_metrics", it)[0]
        tracker.log_iteration(mid, str(tables), "r", it, metrics_version=metrics_version, policy_version=it + 1)
    inputs = client.get_run(mid).inputs.dataset_inputs
    got = {}
    for di in inputs:
        tags = {t.key: t.value for t in di.tags}
        source = mlflow.data.get_source(di)  # a DeltaDatasetSource, read back without Spark
        assert type(source).__name__ == "DeltaDatasetSource" and di.dataset.source_type == "delta_table"
        assert di.dataset.name == tags["mlflow.data.context"] and source.path == str(tables / di.dataset.name)
        assert json.loads(di.dataset.profile)["run_id"] == "r"
        got[(int(tags["rlake.iteration"]), di.dataset.name)] = source.delta_table_version
    assert len(inputs) == len(got) == 2 + 5
    assert got[(-1, "prompts")] == 0  # version 0 survives (MLflow's DeltaDatasetSource.to_dict drops it)
    assert got[(0, "scored_rollouts")] == _versions(tables, "scored_rollouts", 0)[1]
    assert got[(0, "iteration_metrics")] == _versions(tables, "iteration_metrics", 0)[0]


def test_validation_samples_are_an_mlflow_table(tmp_path) -> None:
    tracker = _tracker(tmp_path)
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    mid = tracker.run_for("r", step=2)
    scored = {
        mode: pd.DataFrame(
            {
                "prompt_id": [7] * n,
                "sample_index": range(n),
                "data_source": "rlake/arith",
                "prompt_text": "1+2=",
                "response_text": [f"#### {3 + i}" for i in range(n)],
                "ground_truth": "3",
                "reward": [1.0] + [0.0] * (n - 1),
                "response_length": 6,
                "finish_reason": "stop",
                "policy_version": -1,
                "prompt_token_ids": [[1, 2]] * n,
            }
        )
        for mode, n in (("greedy", 1), ("sampled", 4))
    }
    tables = tmp_path / "tables"
    tracker.log_iteration(mid, str(tables), "r", 1, metrics_version=5, policy_version=2, validation=scored)
    # MlflowClient.load_table searches runs through the global tracking URI, not the client's: read the file
    table = pd.read_json(
        client.download_artifacts(mid, "samples/val_step_2.json", str(tmp_path / "dl")), orient="split", dtype=False
    )
    assert len(table) == 5 and set(table["sampling"]) == {"greedy", "sampled"}
    assert set(table["policy_version"]) == {2} and set(table["iteration_metrics_version"]) == {5}
    greedy = table[table["sampling"] == "greedy"].iloc[0]
    assert (greedy["prompt_text"], greedy["response_text"], greedy["ground_truth"], greedy["reward"]) == (
        "1+2=",
        "#### 3",
        "3",
        1.0,
    )
    assert "prompt_token_ids" not in table
    logged = json.loads(client.get_run(mid).data.tags["mlflow.loggedArtifacts"])
    assert {"path": "samples/val_step_2.json", "type": "table"} in logged


def test_finished_run_gets_its_validation_curve(tables, tmp_path) -> None:
    tracker = _tracker(tmp_path)
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    mid = tracker.run_for("r", step=2)
    tracker.end_run("r", "FINISHED", tables_root=str(tables))
    assert client.get_run(mid).info.status == "FINISHED"
    png = Path(client.download_artifacts(mid, "validation_curve.png", str(tmp_path / "dl")))
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_validation_rewards_by_policy_version(tables) -> None:
    val = validation_rewards(load_run_metrics(tables, "r"))
    assert val.index.tolist() == [0, 1, 2]  # iteration -1 holds policy v0's validation
    assert val[VAL].tolist() == pytest.approx([0.1, 0.3, 0.4]) and val[AUX].tolist() == pytest.approx([0.05, 0.2, 0.3])


def test_rlake_plot_writes_a_png(tables, tmp_path, capsys) -> None:
    out = tmp_path / "fig" / "r.png"
    assert main(["plot", "r", "--tables", str(tables), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert main(["plot", "r", "--tables", str(tables)]) == 0  # default: <output_dir>/plots/<run>.png
    assert (tables.parent / "plots" / "r.png").read_bytes()[:8] == PNG_MAGIC
    capsys.readouterr()
    assert main(["plot", "nope", "--tables", str(tables)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"rlake plot: error: run 'nope' has no rows in {tables / 'iteration_metrics'}; runs there: r"
    assert main(["plot", "r", "--tables", str(tmp_path / "none")]) == 2  # no table: one-line error too
    assert "no iteration_metrics Delta table" in capsys.readouterr().err


def test_run_curves_plot_one_run_whatever_other_runs_the_table_holds(tables) -> None:
    """The iteration_metrics asset's `run_curves` (Dagster UI metadata) draws its own run alone (issue #35: the
    UI's Plots tab put every run's partitions on one axis)."""
    import base64

    from stages.io.plots import run_curves_markdown

    alone = run_curves_markdown(tables, "r")
    assert alone.startswith("![curves of run r](data:image/png;base64,") and alone.endswith(")")
    assert base64.b64decode(alone.split(",", 1)[1][:-1])[:8] == PNG_MAGIC
    for it in (0, 1, 2):  # another run with other values in the same table
        lineage = {"stage": "iteration_metrics", "policy_version": str(it + 1), "upstream": {}, "duration_s": "0.1"}
        rows = _metrics(it, {"critic/score/mean": 5.0 - it, "actor/entropy": 9.0, VAL: 0.9})
        store.write_partition(
            str(tables / "iteration_metrics"), "iteration_metrics", rows, run_id="s", iteration=it, lineage=lineage
        )
    assert run_curves_markdown(tables, "r") == alone  # the same pixels: nothing of run s on run r's axes
    assert run_curves_markdown(tables, "s") != alone


def test_run_metrics_reads_only_the_files_it_has_not_read(tables) -> None:
    """load_run_metrics (the asset's run_curves, every iteration) reads a run's new data files only, and returns what
    a full read of the table returns after new iterations and an overwritten partition."""
    from stages.io import plots

    uri = str(tables / "iteration_metrics")

    def full() -> pd.DataFrame:
        df = store.open_table(uri).to_pandas(partitions=[("run_id", "=", "r")], columns=plots.METRIC_COLUMNS)
        return df.sort_values(["iteration", "metric"]).reset_index(drop=True)

    pd.testing.assert_frame_equal(load_run_metrics(tables, "r"), full(), check_exact=True)
    key = next(k for k in plots._RUN_ROWS if k[0] == uri and k[2] == "r")
    _write(tables, "iteration_metrics", 2, {}, _metrics(2, {VAL: 0.5, "critic/score/mean": 0.7}))
    pd.testing.assert_frame_equal(load_run_metrics(tables, "r"), full(), check_exact=True)
    paths, rows = plots._RUN_ROWS[key][1][-1]
    assert len(paths) == 1 and rows.column("iteration").to_pylist() == [2, 2]  # the new partition's file alone
    _write(tables, "iteration_metrics", 0, {}, _metrics(0, {VAL: 0.25}))  # an overwrite removes a file read before
    pd.testing.assert_frame_equal(load_run_metrics(tables, "r"), full(), check_exact=True)
