"""Two GRPO iterations of the real pipeline (Dagster in-process, local Ray, Delta, MLflow sqlite, gloo worker group)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from deltalake import DeltaTable
from mlflow.tracking import MlflowClient

from stages.dag import ITERATION
from stages.io import store
from stages.io.tables import SCHEMAS
from stages.models.policy import load_policy
from tests.shared_run import RUN

pytestmark = [pytest.mark.slow, pytest.mark.ray]
TABLES = ("prompts", "prompt_batches", "rollouts", "old_logprobs", "scored_rollouts", "advantages", "iteration_metrics")


@pytest.fixture(scope="module")
def trained(ci_tiny_run):
    return ci_tiny_run


def test_every_table_has_schema_rows_and_lineage(trained) -> None:
    out, _ = trained
    cfg_hash = None
    for name in TABLES:
        uri = str(out / "tables" / name)
        dt = DeltaTable(uri)
        assert dt.schema().to_arrow().names == SCHEMAS[name].names, name
        commits = store.commit_lineage(uri, run_id=RUN)
        assert commits, name
        for c in commits:
            assert c["code_version"] and c["config_hash"] and "upstream" in c and c["table"] == name
            cfg_hash = cfg_hash or c["config_hash"]
            assert c["config_hash"] == cfg_hash
    for it in (0, 1):
        rollouts = store.read_partition(str(out / "tables" / "rollouts"), RUN, it)
        assert len(rollouts) == 8 * 4 and set(rollouts["policy_version"]) == {it}
        (c,) = store.commit_lineage(str(out / "tables" / "advantages"), run_id=RUN, iteration=it)
        read = {
            name: store.commit_lineage(str(out / "tables" / name), run_id=RUN, iteration=it)[0]["version"]
            for name in ("scored_rollouts", "rollouts", "old_logprobs")  # rollouts: the token columns
        }
        assert c["upstream"] == read and c["policy_version"] == str(it)


def test_advantages_are_group_relative(trained) -> None:
    out, _ = trained
    adv = store.read_partition(str(out / "tables" / "advantages"), RUN, 0)
    sums = adv.groupby("group_id")["advantage"].sum()
    assert (sums.abs() < 1e-4).all()


def test_policy_moved_and_checkpoints_are_hf(trained) -> None:
    out, _ = trained
    ckpts = out / "checkpoints" / RUN
    v0, _ = load_policy(ckpts / "policy_v0")
    v2, _ = load_policy(ckpts / "policy_v2")
    unchanged = [k for (k, a), b in zip(v0.state_dict().items(), v2.state_dict().values()) if torch.equal(a, b)]
    assert unchanged == []
    assert (ckpts / "policy_v2" / "optimizer.pt").is_file()


def test_mlflow_run_holds_params_and_metrics(trained) -> None:
    out, summary = trained
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rlake-ci")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`rlake.run_id` = '{RUN}'")
    assert run.data.params["rollout.n"] == "4" and run.data.params["algorithm.adv_estimator"] == "grpo"
    for key in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "response_length/mean",
        "timing_s/rollouts",
        "timing_s/update",
        "timing_s/step",
        "val-core/rlake/arith/reward/mean_at_1",
    ):
        assert key in run.data.metrics, key
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")]
    assert steps == [1, 2]
    assert all(
        torch.isfinite(torch.tensor(m.value)) for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")
    )
    assert "config.yaml" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert len(summary["iterations"]) == 2


def test_stage_timings_are_the_durations_their_commits_recorded(trained) -> None:
    """iteration_metrics takes each timed stage's seconds from the commit its asset recorded for the iteration
    (no table opened: assets.iteration_metrics.stage_timings); here no partition was re-written, so that is the
    partition's newest commit."""
    out, _ = trained
    for it in (0, 1):
        rows = store.read_partition(str(out / "tables" / "iteration_metrics"), RUN, it)
        metrics = dict(zip(rows["metric"], rows["value"], strict=True))
        timed = [s for s in ITERATION if s.table and s.timing and (out / "tables" / s.name).is_dir()]
        assert {s.name for s in timed} >= {"prompt_batches", "rollouts", "old_logprobs", "scored_rollouts"}
        for stage in timed:
            commit = store.newest_commit(str(out / "tables" / stage.name), RUN, it)
            assert metrics[stage.timing] == pytest.approx(float(commit["duration_s"])), stage.name


def test_mlflow_run_finished_with_lineage_samples_and_curve(trained) -> None:
    out, _ = trained
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rlake-ci")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`rlake.run_id` = '{RUN}'")
    assert run.info.status == "FINISHED"  # the last iteration ended it
    inputs = {}
    for di in run.inputs.dataset_inputs:
        tags = {t.key: t.value for t in di.tags}
        inputs[(int(tags["rlake.iteration"]), tags["mlflow.data.context"])] = int(tags["rlake.delta_version"])
    for it in (0, 1):
        for name in ("prompt_batches", "rollouts", "scored_rollouts", "advantages", "iteration_metrics"):
            (c,) = store.commit_lineage(str(out / "tables" / name), run_id=RUN, iteration=it)
            assert inputs[(it, name)] == c["version"], (it, name)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "validation_curve.png" in artifacts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "samples")} == {
        f"samples/val_step_{v}.json" for v in (0, 1, 2)
    }  # test_freq 1: v0 and after each iteration
    samples = pd.read_json(
        client.download_artifacts(run.info.run_id, "samples/val_step_2.json", str(out / "dl")),
        orient="split",
        dtype=False,
    )
    assert set(samples["policy_version"]) == {2} and {"prompt_text", "response_text", "ground_truth", "reward"} <= set(
        samples
    )


def test_sql_over_the_run_tables(trained) -> None:
    from stages.io.sql import query

    out, _ = trained
    df = query(
        out / "tables",
        "SELECT iteration, count(*) AS n, avg(reward) AS r FROM scored_rollouts "
        f"WHERE run_id = '{RUN}' GROUP BY iteration ORDER BY iteration",
    )
    assert df["iteration"].tolist() == [0, 1] and df["n"].tolist() == [32, 32]
    v0 = query(out / "tables", "SELECT count(*) AS n FROM rollouts", versions={"rollouts": 0})
    assert v0["n"].iloc[0] == 32  # time travel: version 0 holds iteration 0 only
