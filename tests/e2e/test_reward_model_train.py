"""`rlake train` on configs/ci_tiny.yaml with a reward model (a tiny Qwen2ForSequenceClassification built
in-process): every iteration's scored_rollouts carry the RM's score and version, the training reward is
the RM score (combine=replace, verl's behaviour), `score` keeps the rule score, and validation stays
rule-based."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pipelines.cli import main
from stages.io import store
from stages.io.checkpoints import model_version
from stages.models.tiny import build_tiny_reward_model

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_train_with_a_reward_model_rewards_its_scores(tmp_path, ray_session, capsys) -> None:
    rm = build_tiny_reward_model(tmp_path / "rm", seed=0)
    out = tmp_path / "out"
    os.environ.pop("DAGSTER_HOME", None)  # the run's own output_dir/dagster_home
    try:
        rc = main(
            [
                "train",
                "--config",
                "configs/ci_tiny.yaml",
                "--run-id",
                "rm",
                f"trainer.output_dir={out}",
                "reward.reward_model.enable=true",
                f"reward.reward_model.model_path={rm}",
            ]
        )
    finally:
        os.environ.pop("DAGSTER_HOME", None)
    assert rc == 0, capsys.readouterr().err
    for it in (0, 1):
        scored = store.read_partition(str(out / "tables" / "scored_rollouts"), "rm", it)
        assert len(scored) == 8 * 4 and scored["rm_score"].notna().all()
        assert set(scored["rm_version"]) == {model_version(rm)}
        np.testing.assert_array_equal(scored["reward"], scored["rm_score"])  # replace, no overlong shaping
        assert set(scored["score"]).issubset({0.0, 0.1, 1.0})  # the rule score (format_score 0.1) is kept
        assert scored["rm_score"].std() > 0 and not set(scored["rm_score"]).issubset({0.0, 0.1, 1.0})
    metrics = store.read_partition(str(out / "tables" / "iteration_metrics"), "rm", 1).set_index("metric")["value"]
    assert metrics["critic/score/mean"] == pytest.approx(float(scored["rm_score"].mean()), abs=1e-9)
    val = [k for k in metrics.index if k.startswith("val-core/")]
    # validation scores with the rule reward alone (0, format_score 0.1 or 1 per row), never the RM's
    assert val and all(0.0 <= metrics[k] <= 1.0 for k in val)
