"""PPO with a critic (configs/ppo.yaml, ci_tiny-sized): two iterations of the real pipeline
(Dagster in-process, local Ray, Delta, MLflow sqlite): values table, GAE, critic versions, metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from configs.schema import load_config
from stages.io import store
from stages.train.critic import load_critic

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]
RUN = "ppo-e2e"


def ci_sized_overrides() -> list[str]:
    """Every setting of ci_tiny.yaml except the algorithm and critic sections and the run names, as
    key.sub=value overrides of ppo.yaml: ppo.yaml's PPO/GAE choices at CI size."""

    def flat(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
        out = []
        for k, v in tree.items():
            out += flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]
        return out

    resolved = load_config(ROOT / "configs" / "ci_tiny.yaml").model_dump(mode="json")  # ci_tiny is an overlay
    keep = [
        (k, v)
        for k, v in flat(resolved)
        if not k.startswith(("algorithm.", "critic.", "trainer.experiment_name", "trainer.project_name"))
    ]
    return [f"{k}={json.dumps(v)}" for k, v in keep]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_session):
    import os

    from pipelines.runner import run_training

    out = tmp_path_factory.mktemp("ppo")
    os.environ["DAGSTER_HOME"] = str(out / "dagster_home")
    overrides = ci_sized_overrides() + [f"trainer.output_dir={out}"]
    summary = run_training(str(ROOT / "configs" / "ppo.yaml"), overrides, run_id=RUN, log=lambda s: None)
    yield out, summary
    os.environ.pop("DAGSTER_HOME", None)


def test_values_table_holds_one_value_per_response_token(trained) -> None:
    out, _ = trained
    for it in (0, 1):
        vals = store.read_partition(str(out / "tables" / "values"), RUN, it)
        rollouts = store.read_partition(str(out / "tables" / "rollouts"), RUN, it)
        assert len(vals) == len(rollouts) == 8 * 4 and set(vals["critic_version"]) == {it}
        lengths = dict(zip(rollouts["rollout_id"], rollouts["response_length"]))
        assert all(len(v) == lengths[r] for r, v in zip(vals["rollout_id"], vals["values"]))
        (c,) = store.commit_lineage(str(out / "tables" / "values"), run_id=RUN, iteration=it)
        assert c["stage"] == "values" and set(c["upstream"]) == {"rollouts"}
        (a,) = store.commit_lineage(str(out / "tables" / "advantages"), run_id=RUN, iteration=it)
        assert a["upstream"]["values"] == c["version"]


def test_gae_advantages_are_whitened_token_level(trained) -> None:
    out, _ = trained
    adv = store.read_partition(str(out / "tables" / "advantages"), RUN, 1)
    assert set(adv["adv_estimator"]) == {"gae"}
    flat = np.concatenate([np.asarray(t, dtype=np.float64) for t in adv["token_advantages"]])
    assert abs(flat.mean()) < 1e-4 and flat.std(ddof=1) == pytest.approx(1.0, abs=1e-3)
    assert (np.abs(flat) > 1e-3).mean() > 0.5  # a per-token signal, not all zero
    per_rollout_spread = [np.ptp(t) for t in adv["token_advantages"] if len(t) > 1]
    assert max(per_rollout_spread) > 1e-3  # token-level: GAE differs along a response, unlike GRPO
    assert [len(r) for r in adv["returns"]] == [len(t) for t in adv["token_advantages"]]


def test_critic_versions_are_written_and_move(trained) -> None:
    out, _ = trained
    ckpts = out / "checkpoints" / RUN
    v0, _ = load_critic(ckpts / "critic_v0")
    for v in (1, 2):
        model, _ = load_critic(ckpts / f"critic_v{v}")
        assert (ckpts / f"critic_v{v}" / "optimizer.pt").is_file()
        assert not torch.equal(model.score.weight, v0.score.weight)
        moved = [k for (k, a), b in zip(v0.state_dict().items(), model.state_dict().values()) if not torch.equal(a, b)]
        assert len(moved) > len(v0.state_dict()) // 2, moved  # the backbone trains too, not only the head


def test_critic_metrics_reach_mlflow_and_the_metrics_table(trained) -> None:
    out, summary = trained
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rlake")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`rlake.run_id` = '{RUN}'")
    assert run.data.params["algorithm.adv_estimator"] == "gae"
    history = client.get_metric_history(run.info.run_id, "critic/vf_loss")
    assert [m.step for m in history] == [1, 2] and all(math.isfinite(m.value) and m.value > 0 for m in history)
    for key in (
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/values/mean",
        "critic/returns/mean",
        "critic/advantages/mean",
        "critic/vf_explained_var",
        "actor/pg_loss",
    ):
        assert key in run.data.metrics, key
    assert 0.0 <= run.data.metrics["critic/vf_clipfrac"] <= 1.0
    rows = store.read_partition(str(out / "tables" / "iteration_metrics"), RUN, 1)
    table = dict(zip(rows["metric"], rows["value"]))
    assert table["critic/vf_loss"] == pytest.approx(run.data.metrics["critic/vf_loss"])
    assert abs(table["critic/advantages/mean"]) < 1e-4
    assert len(summary["iterations"]) == 2
