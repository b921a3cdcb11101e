"""actor.mixed_precision.param_dtype='bfloat16' (stages.train.precision): bf16 compute over float32 weights,
against the float32 update on the tiny model, on the CPU.

Tolerances, and why (measured on the tiny model in brackets): bf16 keeps 8 significand bits, so every
matmul output is rounded at a relative 2^-9 ~ 2e-3; a log-prob is a difference of logits of order 1-10,
so per-token log-probs move by up to ~1e-2 (bound 2e-2 [max 2.7e-3 at T=0.7]). Loss-like means over many tokens
average the rounding out: pg_loss rel 1e-2 [1.2e-3], entropy rel 1e-4 [2e-7], grad_norm rel 1e-3 [7.5e-5].
The weights after the update are compared by the L2 of their difference against the fp32 step (bound 0.2
[0.062]), not elementwise: AdamW's first steps move each weight by about lr x sign(gradient), so a weight
whose gradient is near 0 can step the other way under bf16 rounding (up to 2 x lr apart).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from configs.schema import ActorConfig, OptimConfig
from stages.models.policy import load_policy
from stages.train.actor import compute_logprobs, ppo_update
from stages.train.batching import pad_rollouts
from stages.train.optim import make_optimizer

sys.path.insert(0, str(Path(__file__).parent))
from helpers_rollouts import as_trainer_rows, make_rows

LOGPROB_ATOL = 2e-2
UPDATE_RTOL = 0.2
METRIC_RTOL = {"actor/pg_loss": 1e-2, "actor/entropy": 1e-4, "actor/grad_norm": 1e-3}


def _actor(param_dtype: str, **kw) -> ActorConfig:
    base = dict(ppo_mini_batch_size=2, ppo_micro_batch_size=4, num_workers=1, optim=OptimConfig(lr=1e-3))
    return ActorConfig(**{**base, **kw, "mixed_precision": {"param_dtype": param_dtype}})


def _update(ckpt, param_dtype: str, rows: dict, **kw):
    torch.manual_seed(0)
    model, tok = load_policy(ckpt)
    actor = _actor(param_dtype, **kw)
    opt, sched = make_optimizer(model, actor.optim)
    m = ppo_update(model, opt, sched, rows, actor, n_per_prompt=4, pad_id=tok.pad_token_id, seed=0)
    return model, opt, m


@pytest.fixture(scope="module")
def updates(tiny_checkpoint) -> dict:
    rows = as_trainer_rows(make_rows(16))
    return {p: _update(tiny_checkpoint, p, rows) for p in ("float32", "bfloat16")}


def test_bf16_logprobs_are_float32_and_close_to_fp32(tiny_checkpoint) -> None:
    model, tok = load_policy(tiny_checkpoint)
    rows = as_trainer_rows(make_rows(8))
    batch = pad_rollouts(rows["prompt_token_ids"], rows["response_token_ids"], tok.pad_token_id)
    fp32 = compute_logprobs(model, batch, 4, 0.7)  # (N, L)
    bf16 = compute_logprobs(model, batch, 4, 0.7, param_dtype="bfloat16")  # (N, L)
    mask = batch["response_mask"].bool()
    assert bf16.dtype == torch.float32
    gap = (fp32 - bf16).abs()[mask]
    assert gap.max() > 0, "bf16 log-probs equal fp32 bit for bit: autocast did not run"
    assert gap.max() < LOGPROB_ATOL, f"max |fp32 - bf16| log-prob {float(gap.max()):.2e}"


def test_bf16_update_matches_fp32(updates, tiny_checkpoint) -> None:
    (m32, _, met32), (m16, _, met16) = updates["float32"], updates["bfloat16"]
    for key, rtol in METRIC_RTOL.items():
        assert met16[key] == pytest.approx(met32[key], rel=rtol), key
    assert met16["actor/pg_loss"] != met32["actor/pg_loss"], "bf16 and fp32 losses are equal: autocast did not run"
    w0, _ = load_policy(tiny_checkpoint)
    w0, w32, w16 = w0.state_dict(), m32.state_dict(), m16.state_dict()
    diff = torch.cat([(w32[k] - w16[k]).flatten() for k in w0]).norm()
    step = torch.cat([(w32[k] - w0[k]).flatten() for k in w0]).norm()
    assert diff / step < UPDATE_RTOL, f"bf16 update differs from fp32 by {float(diff / step):.3f} of the step"


def test_bf16_keeps_float32_master_weights_and_optimizer_state(updates) -> None:
    model, opt, _ = updates["bfloat16"]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    moments = {s[k].dtype for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")}
    assert moments == {torch.float32}


def test_bf16_single_step_is_on_policy(tiny_checkpoint) -> None:
    """Old log-probs recomputed at the update's precision over the same micro-batch: ratio == 1 exactly."""
    _, _, m = _update(tiny_checkpoint, "bfloat16", as_trainer_rows(make_rows(8)), ppo_micro_batch_size=8)
    assert m["actor/ppo_kl"] == 0.0 and m["actor/pg_clipfrac"] == 0.0


def test_ref_logprobs_use_the_actors_precision(tiny_checkpoint) -> None:
    """The reference worker at param_dtype bfloat16 gives the trainer's bf16 recomputation, not the fp32 one."""
    from stages.ref_logprobs import compute_ref_logprobs

    df = make_rows(4)
    df["response_length"] = df["response_token_ids"].map(len)
    ref = compute_ref_logprobs(
        df, model_dir=str(tiny_checkpoint), micro_batch_size=4, use_ray=False, param_dtype="bfloat16"
    )
    model, tok = load_policy(tiny_checkpoint)
    batch = pad_rollouts(list(df["prompt_token_ids"]), list(df["response_token_ids"]), tok.pad_token_id)
    want = compute_logprobs(model, batch, 4, param_dtype="bfloat16")  # (N, L)
    fp32 = compute_logprobs(model, batch, 4)  # (N, L)
    got = [np.asarray(r) for r in ref["ref_logprobs"]]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate([want[i, : len(r)] for i, r in enumerate(got)]))
    assert not np.array_equal(np.concatenate(got), np.concatenate([fp32[i, : len(r)] for i, r in enumerate(got)]))


def test_megatron_with_bf16_is_refused_at_load() -> None:
    """Megatron's update keeps float32 parameters under plain AdamW and megatron's linear backward fails under
    CPU autocast, so the combination is a config error naming the backends that do bf16."""
    with pytest.raises(ValueError, match="not supported with actor.strategy='megatron'.*'torch' or 'fsdp'"):
        ActorConfig(strategy="megatron", mixed_precision={"param_dtype": "bfloat16"})
    assert ActorConfig(strategy="fsdp", mixed_precision={"param_dtype": "bfloat16"}).strategy == "fsdp"
