"""Persistent workers on a real local Ray: the actor group keeps the policy resident across
updates (and gives the same result as loading from disk), rollout workers keep their engine and take
new weights in place, and a killed actor is rebuilt."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from configs.schema import ActorConfig, OptimConfig, RolloutConfig
from stages.io import store
from stages.io.checkpoints import CHECKPOINT_ID
from stages.models.policy import encode_chat, load_policy
from stages.policy_checkpoint import actor_group, run_update
from stages.rollouts import generate_rollouts, sampling_from_config
from stages.workers.group import shutdown_worker_groups
from stages.workers.requests import UpdateRequest
from stages.workers.rollout_worker import RolloutWorker

sys.path.insert(0, str(Path(__file__).parent))
from helpers_rollouts import make_rows

pytestmark = pytest.mark.ray


def _request(tmp_path: Path, policy_dir: Path, out: str, iteration: int) -> UpdateRequest:
    df = make_rows(16, seed=iteration)
    uri = str(tmp_path / "advantages")
    version = store.write_partition(uri, "advantages", df, run_id="r", iteration=iteration, lineage={"stage": "test"})
    actor = ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size=4, num_workers=2, optim=OptimConfig(lr=1e-3))
    return UpdateRequest(
        run_id="r",
        iteration=iteration,
        advantages_uri=uri,
        advantages_version=version,
        policy_dir=str(policy_dir),
        out_dir=str(tmp_path / out),
        actor=actor,
        n_per_prompt=4,
        seed=iteration,
    )


def _weights(path: Path) -> list[torch.Tensor]:
    return list(load_policy(path)[0].state_dict().values())


def test_resident_update_equals_update_from_disk(ray_session, tiny_checkpoint, tmp_path) -> None:
    shutdown_worker_groups()
    first = run_update(_request(tmp_path, tiny_checkpoint, "v1", 0))
    assert first["actor/weights_loaded_from_disk"] == 1.0
    resident = run_update(_request(tmp_path, tmp_path / "v1", "v2", 1))
    assert resident["actor/weights_loaded_from_disk"] == 0.0  # the group kept v1 and its optimizer

    shutdown_worker_groups()  # fresh processes: v1 must come from disk this time
    from_disk = run_update(_request(tmp_path, tmp_path / "v1", "v2_disk", 1))
    assert from_disk["actor/weights_loaded_from_disk"] == 1.0
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm"):
        assert resident[key] == pytest.approx(from_disk[key], rel=1e-6, abs=1e-9), key
    worst = max((a - b).abs().max().item() for a, b in zip(_weights(tmp_path / "v2"), _weights(tmp_path / "v2_disk")))
    assert worst == 0.0, f"resident vs from-disk update differ by {worst:.2e}"


def test_rewritten_input_checkpoint_is_reloaded(ray_session, tiny_checkpoint, tmp_path) -> None:
    run_update(_request(tmp_path, tiny_checkpoint, "v1", 0))
    (tmp_path / "v1" / CHECKPOINT_ID).write_text("rewritten-elsewhere")  # e.g. a re-materialized iteration
    again = run_update(_request(tmp_path, tmp_path / "v1", "v2", 1))
    assert again["actor/weights_loaded_from_disk"] == 1.0


def test_killed_trainer_worker_is_rebuilt_and_update_completes(ray_session, tiny_checkpoint, tmp_path) -> None:
    import ray

    req = _request(tmp_path, tiny_checkpoint, "v1", 0)
    pid = ray.get(actor_group(req).handles[1].pid.remote())  # the group run_update will use
    os.kill(pid, signal.SIGKILL)
    metrics = run_update(req)
    assert metrics["actor/num_rollouts"] == 16.0 and (tmp_path / "v1" / "config.json").is_file()
    assert not (tmp_path / "v1.tmp").exists()


def _prompt_batch(tok) -> pd.DataFrame:
    prompts = [encode_chat(tok, [{"role": "user", "content": f"{i}+2="}])[0] for i in range(4)]
    return pd.DataFrame({"prompt_id": range(4), "prompt_token_ids": prompts, "group_id": range(4), "policy_version": 0})


def test_rollout_workers_keep_engine_and_sync_weights_in_place(ray_session, tiny_checkpoint, tmp_path) -> None:
    _, tok = load_policy(tiny_checkpoint)
    batch = _prompt_batch(tok)
    cfg = RolloutConfig(name="hf", n=2, num_workers=1)
    kw = {"rollout_cfg": cfg, "max_tokens": 6, "seed": 0, "greedy": True}
    shutdown_worker_groups()
    first = generate_rollouts(batch, model_dir=str(tiny_checkpoint), **kw)
    again = generate_rollouts(batch, model_dir=str(tiny_checkpoint), **kw)
    assert set(first["engine_sync"]) == {"build"} and set(again["engine_sync"]) == {"cached"}

    run_update(_request(tmp_path, tiny_checkpoint, "v1", 0))
    updated = generate_rollouts(batch, model_dir=str(tmp_path / "v1"), **kw)
    assert set(updated["engine_sync"]) == {"in_place"}
    fresh = RolloutWorker(0, 1, 1, engine="hf")
    reference = fresh.generate(str(tmp_path / "v1"), batch, sampling_from_config(cfg, 6, seed=0, greedy=True))
    assert updated["response_token_ids"].map(list).tolist() == reference["response_token_ids"].map(list).tolist()
    diffs = [
        abs(a - b) for x, y in zip(updated["rollout_logprobs"], reference["rollout_logprobs"]) for a, b in zip(x, y)
    ]
    assert max(diffs) < 1e-5
