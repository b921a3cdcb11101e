"""`rlake train` end to end with actor.strategy=megatron (TP=2 over gloo, on the persistent gloo worker group)."""

from __future__ import annotations

import os

import pytest

from stages.io import store
from stages.models.policy import load_policy

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.megatron]


def test_one_iteration_with_megatron_tp2(tmp_path, ray_session) -> None:
    from pipelines.runner import run_training

    os.environ["DAGSTER_HOME"] = str(tmp_path / "dagster_home")
    try:
        summary = run_training(
            "configs/ci_tiny.yaml",
            [
                f"trainer.output_dir={tmp_path}",
                "actor.strategy=megatron",
                "actor.megatron.tensor_model_parallel_size=2",
            ],
            run_id="mega",
            steps=1,
            log=lambda s: None,
        )
    finally:
        os.environ.pop("DAGSTER_HOME", None)
    assert len(summary["iterations"]) == 1
    metrics = store.read_partition(str(tmp_path / "tables" / "iteration_metrics"), "mega", 0)
    values = dict(zip(metrics["metric"], metrics["value"]))
    assert values["actor/num_rollouts"] == 32.0 and values["actor/grad_norm"] > 0
    v1, _ = load_policy(tmp_path / "checkpoints" / "mega" / "policy_v1")  # HF format, loadable
    v0, _ = load_policy(tmp_path / "checkpoints" / "mega" / "policy_v0")
    assert any((a != b).any() for a, b in zip(v0.state_dict().values(), v1.state_dict().values()))
