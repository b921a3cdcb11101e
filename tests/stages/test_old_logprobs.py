"""The old_logprobs stage: the actor's recomputed log-probs equal the rollout engine's for the policy that
sampled (iteration 0 on the tiny model), the actor keeps the policy resident for the update that follows,
and the update takes its PPO ratio denominator from the table."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from configs.schema import ActorConfig, OptimConfig, RolloutConfig
from stages.io import store
from stages.io.stage_exec import Partition
from stages.models.policy import encode_chat, load_policy, save_policy
from stages.old_logprobs import compute_old_logprobs, old_logprob_shards, old_logprobs_gap, probs_gap
from stages.rollouts import generate_rollouts
from stages.workers.actor_worker import ActorWorker, stored_old_logprobs
from stages.workers.requests import UpdateRequest
from stages.workers.shard_io import Sink
from stages.workers.sharded import commit_shards

sys.path.insert(0, str(Path(__file__).parent))
from helpers_rollouts import make_rows

ACTOR = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size=4, num_workers=1, optim=OptimConfig(lr=1e-3))


def _rollouts(model_dir, n_prompts: int = 5, n: int = 3, temperature: float = 1.0) -> pd.DataFrame:
    _, tok = load_policy(model_dir)
    prompts = [encode_chat(tok, [{"role": "user", "content": f"{i * 7}+{i}="}])[0] for i in range(n_prompts)]
    batch = pd.DataFrame(
        {"prompt_id": range(n_prompts), "prompt_token_ids": prompts, "group_id": range(n_prompts), "policy_version": 0}
    )
    cfg = RolloutConfig(name="hf", n=n, temperature=temperature)
    return generate_rollouts(batch, model_dir=str(model_dir), rollout_cfg=cfg, max_tokens=6, seed=0, use_ray=False)


@pytest.fixture(scope="module")
def pad_is_eos_checkpoint(tiny_checkpoint, tmp_path_factory):
    """tiny_checkpoint with pad == eos, so the HF engine samples from the model's plain softmax (as in
    test_ref_logprobs: with a separate pad token it renormalizes without it, which the trainer does not)."""
    model, tok = load_policy(tiny_checkpoint)
    tok.pad_token = tok.eos_token
    return save_policy(model, tok, tmp_path_factory.mktemp("pad_eos_old") / "policy_v0")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_old_logprobs_of_the_sampling_policy_equal_rollout_logprobs(pad_is_eos_checkpoint, temperature) -> None:
    out = _rollouts(pad_is_eos_checkpoint, temperature=temperature)
    old = compute_old_logprobs(
        out.iloc[::-1], policy_dir=str(pad_is_eos_checkpoint), actor=ACTOR, temperature=temperature, use_ray=False
    )
    assert old["rollout_id"].tolist() == sorted(out["rollout_id"])  # sorted, whatever the input order
    assert (old["old_logprobs"].map(len).to_numpy() == out["response_length"].to_numpy()).all()
    assert set(old["policy_version"]) == {0}
    got = np.concatenate([np.asarray(x) for x in old["old_logprobs"]])
    want = np.concatenate([np.asarray(x) for x in out["rollout_logprobs"]])
    assert got.size == want.size > 0 and (got < 0).all()
    np.testing.assert_allclose(got, want, atol=1e-4)
    # the per-rollout gap |exp(old) - exp(engine)| is the algos function's, and tiny here
    metrics, row_max, row_mean = probs_gap(old["old_logprobs"].tolist(), out["rollout_logprobs"].tolist())
    np.testing.assert_array_equal(old["rollout_probs_diff_max"], row_max.numpy())
    np.testing.assert_array_equal(old["rollout_probs_diff_mean"], row_mean.numpy())
    assert (old["rollout_probs_diff_max"] < 1e-4).all() and metrics["training/rollout_probs_diff_valid"] == 1
    assert metrics["training/rollout_actor_probs_pearson_corr"] > 0.9999


def _advantages(tmp_path: Path, df: pd.DataFrame) -> tuple[str, int]:
    uri = str(tmp_path / "advantages")
    return uri, store.write_partition(uri, "advantages", df, run_id="r", iteration=0, lineage={"stage": "test"})


def _request(uri: str, version: int, policy_dir, out_dir: Path) -> UpdateRequest:
    return UpdateRequest(
        run_id="r",
        iteration=0,
        advantages_uri=uri,
        advantages_version=version,
        policy_dir=str(policy_dir),
        out_dir=str(out_dir),
        actor=ACTOR,
        n_per_prompt=4,
        seed=0,
    )


def _weights(path: Path) -> list[torch.Tensor]:
    return list(load_policy(path)[0].state_dict().values())


def test_update_after_compute_log_prob_reuses_the_resident_policy(tiny_checkpoint, tmp_path) -> None:
    """Policy version 0 (no checkpoint id) loaded by compute_log_prob stays resident: the update loads nothing,
    and gives the same checkpoint as a fresh worker's update from disk on the same table."""
    rows = make_rows(8)
    worker = ActorWorker(0, 1, torch.get_num_threads())
    old = worker.compute_log_prob(str(tiny_checkpoint), rows, ACTOR, 1.0)
    assert old["rollout_id"].tolist() == rows["rollout_id"].tolist()
    uri, version = _advantages(tmp_path, rows.assign(old_logprobs=old["old_logprobs"]))
    resident = worker.update(_request(uri, version, tiny_checkpoint, tmp_path / "v1"))
    assert resident["actor/weights_loaded_from_disk"] == 0.0
    from_disk = ActorWorker(0, 1, torch.get_num_threads()).update(
        _request(uri, version, tiny_checkpoint, tmp_path / "v1_disk")
    )
    assert from_disk["actor/weights_loaded_from_disk"] == 1.0
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm"):
        assert resident[key] == pytest.approx(from_disk[key], rel=1e-6, abs=1e-9), key
    worst = max((a - b).abs().max().item() for a, b in zip(_weights(tmp_path / "v1"), _weights(tmp_path / "v1_disk")))
    assert worst == 0.0, f"resident vs from-disk update differ by {worst:.2e}"
    # the next iteration's compute_log_prob finds the policy the update wrote: still nothing loaded
    worker.compute_log_prob(str(tmp_path / "v1"), rows, ACTOR, 1.0)
    assert worker.resident is not None and worker.resident.holds(str(tmp_path / "v1"), ACTOR.optim)


def test_update_takes_the_ratio_denominator_from_the_table(tiny_checkpoint, tmp_path) -> None:
    """ppo_kl is the mean of old - new log-probs at the first micro-batch: the table's old log-probs shifted
    by +0.1 move it by ~+0.1; without them in the table the update recomputes them (ppo_kl ~ the table's)."""
    rows = make_rows(8)
    old = ActorWorker(0, 1, torch.get_num_threads()).compute_log_prob(str(tiny_checkpoint), rows, ACTOR, 1.0)
    shifted = [[x + 0.1 for x in lp] for lp in old["old_logprobs"]]
    kl = {}
    for name, column in (("table", list(old["old_logprobs"])), ("shifted", shifted), ("recomputed", None)):
        df = rows if column is None else rows.assign(old_logprobs=column)
        uri, version = _advantages(tmp_path / name, df)
        req = _request(uri, version, tiny_checkpoint, tmp_path / f"out_{name}")
        metrics = ActorWorker(0, 1, torch.get_num_threads()).update(req)
        kl[name] = metrics["actor/ppo_kl"]
    assert kl["recomputed"] == pytest.approx(kl["table"], abs=1e-6)
    assert kl["shifted"] - kl["table"] == pytest.approx(0.1, abs=0.02)


def test_stored_old_logprobs_of_another_length_are_refused() -> None:
    rows = make_rows(4)
    assert stored_old_logprobs(rows) is None  # no column: the update recomputes them
    assert stored_old_logprobs(rows.assign(old_logprobs=[[]] * 4)) is None  # an older table: empty lists
    good = [[-1.0] * len(r) for r in rows["response_token_ids"]]
    assert stored_old_logprobs(rows.assign(old_logprobs=good)) == good
    with pytest.raises(ValueError, match=r"rollouts \[2\] of the advantages table have old_logprobs"):
        stored_old_logprobs(rows.assign(old_logprobs=[*good[:2], good[2][:-1], good[3]]))


def test_megatron_actor_computes_with_torch_and_keeps_nothing(tiny_checkpoint) -> None:
    rows = make_rows(4)
    megatron = ActorConfig(strategy="megatron", ppo_mini_batch_size=1, ppo_micro_batch_size=2, num_workers=1)
    worker = ActorWorker(0, 1, torch.get_num_threads(), strategy="megatron")
    got = worker.compute_log_prob(str(tiny_checkpoint), rows, megatron, 1.0)
    want = ActorWorker(0, 1, torch.get_num_threads()).compute_log_prob(str(tiny_checkpoint), rows, ACTOR, 1.0)
    assert worker.resident is None
    for a, b in zip(got["old_logprobs"], want["old_logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="reached a 'megatron' ActorWorker"):
        worker.compute_log_prob(str(tiny_checkpoint), rows, ACTOR, 1.0)


@pytest.mark.ray
def test_old_logprobs_on_the_actor_group_then_update_loads_nothing(ray_session, tiny_checkpoint, tmp_path) -> None:
    """Two actor ranks of the update's own group each read a contiguous slice of the rollouts partition from
    Delta, compute, and write their rows; the step commits once and never holds a row. The table equals the
    in-process computation, in rollout order, with the gap metrics of the whole batch; the update that follows on
    that group finds policy version 0 resident on both ranks."""
    from stages.policy_checkpoint import run_update
    from stages.workers.group import shutdown_worker_groups

    shutdown_worker_groups()
    actor = ACTOR.model_copy(update={"num_workers": 2, "ppo_mini_batch_size": 2})
    gen = np.random.default_rng(0)
    rows = make_rows(16).assign(
        rollout_logprobs=lambda d: [list(-gen.random(len(r)) * 2) for r in d["response_token_ids"]]
    )
    rollouts = str(tmp_path / "rollouts")  # an advantages-shaped table of the rows: a slice reads any table
    version = store.write_partition(rollouts, "advantages", rows, run_id="r", iteration=0, lineage={"stage": "test"})
    sink = Sink(str(tmp_path / "old_logprobs"), "old_logprobs", "r", 0)
    results = old_logprob_shards(
        Partition(rollouts, "r", 0, version), policy_dir=str(tiny_checkpoint), actor=actor, sink=sink
    )
    assert [r.frame for r in results] == [None, None] and [len(r.files) for r in results] == [1, 1]
    assert [r.rows for r in results] == [8, 8]  # rank i: rollouts 8i .. 8i+7, read there
    written = commit_shards(sink, results, {"stage": "old_logprobs"})
    remote = store.read_partition(sink.uri, "r", 0, version=written)
    local = compute_old_logprobs(rows, policy_dir=str(tiny_checkpoint), actor=actor, use_ray=False)
    assert remote["rollout_id"].tolist() == local["rollout_id"].tolist() == list(range(16))
    for a, b in zip(remote["old_logprobs"], local["old_logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(remote["rollout_probs_diff_max"], local["rollout_probs_diff_max"], atol=1e-5)
    whole, _, _ = probs_gap(remote["old_logprobs"].tolist(), rows["rollout_logprobs"].tolist())
    assert old_logprobs_gap(results) == pytest.approx(whole, rel=1e-9)  # merged from the ranks' moments
    remote = remote.drop(columns=["run_id", "iteration"])
    uri, version = _advantages(
        tmp_path, rows.drop(columns="rollout_logprobs").assign(old_logprobs=remote["old_logprobs"])
    )
    req = _request(uri, version, tiny_checkpoint, tmp_path / "v1")
    metrics = run_update(replace(req, actor=actor))
    assert metrics["actor/weights_loaded_from_disk"] == 0.0  # averaged over both ranks
