"""Torch PPO backend without Ray: parameters move, ratios start at 1, zero advantage is a no-op, golden losses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from configs.schema import ActorConfig, OptimConfig
from stages.models.policy import load_policy
from stages.train.actor import ppo_update
from stages.train.optim import make_optimizer

sys.path.insert(0, str(Path(__file__).parent))
from helpers_rollouts import as_trainer_rows, make_rows

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "grpo_tiny.json"


def _actor(**kw) -> ActorConfig:
    base = dict(ppo_mini_batch_size=2, ppo_micro_batch_size=4, num_workers=1, optim=OptimConfig(lr=1e-3))
    return ActorConfig(**{**base, **kw})


def _update(ckpt, rows, actor, n_per_prompt=4, seed=0):
    torch.manual_seed(0)
    model, tok = load_policy(ckpt)
    opt, sched = make_optimizer(model, actor.optim)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = ppo_update(model, opt, sched, rows, actor, n_per_prompt=n_per_prompt, pad_id=tok.pad_token_id, seed=seed)
    return model, before, m


def test_every_parameter_changes_and_metrics_are_finite(tiny_checkpoint) -> None:
    model, before, m = _update(tiny_checkpoint, as_trainer_rows(make_rows(16)), _actor())
    unchanged = [k for k, v in model.state_dict().items() if torch.equal(v, before[k])]
    assert unchanged == []
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    assert {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
    } <= set(m)


def test_single_step_is_on_policy(tiny_checkpoint) -> None:
    """One mini-batch, one micro-batch: old_logprobs are the policy's own, so ratio == 1 exactly."""
    actor = _actor(ppo_mini_batch_size=2, ppo_micro_batch_size=8)
    _, _, m = _update(tiny_checkpoint, as_trainer_rows(make_rows(8)), actor)
    assert m["actor/ppo_kl"] == 0.0 and m["actor/pg_clipfrac"] == 0.0


def test_zero_advantages_leave_weights_unchanged(tiny_checkpoint) -> None:
    rows = as_trainer_rows(make_rows(8))
    rows["advantages"] = torch.zeros(8)
    model, before, m = _update(tiny_checkpoint, rows, _actor())
    assert m["actor/pg_loss"] == 0.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_batch_short_of_whole_mini_batches_still_updates(tiny_checkpoint) -> None:
    """10 rollouts, mini-batches of 8 (reward.on_error=flag dropped some): ceil(10 / 8) = 2 optimizer steps of 5
    rows each, as a whole batch would take; it used to fail an assertion."""
    model, before, metrics = _update(tiny_checkpoint, as_trainer_rows(make_rows(10)), _actor())
    assert metrics["actor/num_rollouts"] == 10.0 and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


GOLDEN_KEYS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl")


def golden_losses(ckpt) -> list[list[float]]:
    """Metrics of 3 successive updates (2 epochs x 2 mini-batches each, so ratios move off 1) on fixed rows."""
    torch.set_num_threads(1)
    model, tok = load_policy(ckpt)
    actor = _actor(ppo_mini_batch_size=1, ppo_micro_batch_size=2, ppo_epochs=2)
    opt, sched = make_optimizer(model, actor.optim)
    rows = as_trainer_rows(make_rows(8, seed=1))
    out = []
    for s in range(3):
        m = ppo_update(model, opt, sched, rows, actor, n_per_prompt=4, pad_id=tok.pad_token_id, seed=s)
        out.append([m[k] for k in GOLDEN_KEYS])
    return out


def test_losses_match_golden(tiny_checkpoint) -> None:
    golden = json.loads(GOLDEN.read_text())
    got = golden_losses(tiny_checkpoint)
    assert golden["keys"] == list(GOLDEN_KEYS)
    for step, (g, want) in enumerate(zip(got, golden["metrics"], strict=True)):
        assert g == pytest.approx(want, rel=1e-4, abs=1e-7), f"update {step}: {dict(zip(GOLDEN_KEYS, g, strict=True))}"
    assert got[0][0] != got[1][0]  # the losses really depend on the evolving weights


@pytest.mark.parametrize("rollout_temperature,expected", [(0.7, 0.7), (1.0, 1.0), (0.0, 1.0)])
def test_update_job_divides_logits_by_the_rollout_temperature(rollout_temperature, expected) -> None:
    """verl's actor (and ref) log-probs use rollout.temperature; greedy rollouts (0) mean plain logits."""
    from configs.schema import load_config
    from stages.policy_checkpoint import update_request

    cfg = load_config("configs/ci_tiny.yaml", [f"rollout.temperature={rollout_temperature}"])
    req = update_request(cfg, 3, advantages_uri="/x", advantages_version=1, policy_dir="/p", out_dir="/o")
    assert req.temperature == expected


def test_tempered_logprobs_are_log_softmax_of_scaled_logits(tiny_checkpoint) -> None:
    from stages.models.policy import load_policy
    from stages.train.actor import compute_logprobs
    from stages.train.batching import pad_rollouts, response_logits

    model, tok = load_policy(tiny_checkpoint)
    batch = pad_rollouts([[1, 5, 7], [2, 3]], [[4, 6], [8, 9, 10]], tok.pad_token_id)
    logits = response_logits(model, batch)  # (2, 3, V)
    want = torch.log_softmax(logits / 0.5, dim=-1).gather(-1, batch["responses"][..., None])[..., 0]  # (2, 3)
    got = compute_logprobs(model, batch, 1, temperature=0.5)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-6, rtol=0)
