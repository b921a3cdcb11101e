"""actor.mixed_precision.master_weights='fp32_master' (stages.train.master): bf16 parameters, float32 AdamW masters.

Expectation, derived: with bf16 parameters W16 = bf16(M) the trainer must take exactly the steps of a float32
AdamW whose parameters are M and whose gradients are the bf16 model's, cast to float32 and summed over the
micro-batches in float32, then clipped in float32: g = sum_k float32(dL_k/dW16), M <- AdamW(M, clip(g)),
W16 <- bf16(M). The reference below computes that by hand (torch.autograd.grad on a second bf16 copy, a plain
torch AdamW over float32 tensors), with the same operations in the same order, so the masters must be equal
bit for bit, not close. The resume test is bit-exact for the same reason: the checkpoint holds M itself.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from configs.schema import ActorConfig, OptimConfig, TinyModelConfig
from stages.models.policy import load_policy
from stages.models.tiny import build_char_tokenizer, build_tiny_model
from stages.train.actor import ppo_update
from stages.train.master import MasterAdamW, float32_params
from stages.train.optim import make_optimizer

sys.path.insert(0, str(Path(__file__).parent))
from helpers_backend_update import load_out, policy_and_advantages, update_request
from helpers_rollouts import as_trainer_rows, make_rows

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.01}
CLIP = 0.5
FSDP_ATOL = 1e-6


def _loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of input_ids (n, T) under model, float32 logits."""
    logits = model(input_ids=input_ids).logits.float()  # (n, T, V)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())


def _reference_step(model16, masters: list[torch.Tensor], opt: torch.optim.AdamW, micro: list) -> torch.Tensor:
    """One float32 AdamW step of `masters` on model16's bf16 gradients, summed over `micro` in float32."""
    params = list(model16.parameters())
    for k, ids in enumerate(micro):
        grads = torch.autograd.grad(_loss(model16, ids), params)
        for m, g in zip(masters, grads, strict=True):
            m.grad = g.float() if k == 0 else m.grad.add_(g.float())
    norm = torch.nn.utils.clip_grad_norm_(masters, CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, m in zip(params, masters, strict=True):
            p.copy_(m)
    return norm


def test_masters_equal_a_float32_adamw_on_bf16_gradients() -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), len(tok), seed=0)
    ref16 = copy.deepcopy(model)
    ref_masters = [p.detach().clone() for p in ref16.parameters()]
    for p in ref16.parameters():
        p.data = p.data.to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref_masters, **ADAMW)
    opt = MasterAdamW(model, **ADAMW)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        micro = [torch.randint(5, len(tok), (2, 9), generator=gen) for _ in range(2)]  # 2 micro-batches
        for ids in micro:
            _loss(model, ids).backward()
        norm = opt.finish_grads(CLIP)
        opt.step()
        opt.zero_grad()
        want_norm = _reference_step(ref16, ref_masters, ref_opt, micro)
        assert torch.equal(norm, want_norm), f"step {step}: grad norm {norm} != {want_norm}"
        assert norm > CLIP, "the clip never acted: the test does not cover it"
    for m, r, p in zip(opt.masters, ref_masters, model.parameters(), strict=True):
        assert torch.equal(m, r)
        assert torch.equal(p, m.to(torch.bfloat16)), "the bf16 parameters are not the masters rounded"
    # the masters carry what bf16 cannot: at lr 1e-2 some updates are below a bf16 ulp of the weight
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in opt.masters)


def _actor(**kw) -> ActorConfig:
    base = dict(ppo_mini_batch_size=1, ppo_micro_batch_size=2, num_workers=1, optim=OptimConfig(lr=1e-3))
    mp = {"param_dtype": "bfloat16", "master_weights": "fp32_master"}
    return ActorConfig(**{**base, **kw, "mixed_precision": mp})


def test_params_are_bf16_and_masters_and_adamw_state_float32(tiny_checkpoint, tmp_path) -> None:
    model, tok = load_policy(tiny_checkpoint)
    actor = _actor()
    opt, sched = make_optimizer(model, actor.optim, actor.mixed_precision.master_weights)
    before = [m.clone() for m in opt.masters]
    rows = as_trainer_rows(make_rows(8))
    metrics = ppo_update(model, opt, sched, rows, actor, n_per_prompt=4, pad_id=tok.pad_token_id, seed=0)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} <= {torch.float32}, "buffers (rotary inv_freq) must stay float32"
    assert {m.dtype for m in opt.masters} == {torch.float32}
    assert {s[k].dtype for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")} == {torch.float32}
    assert all(p.grad is None for p in model.parameters()), "bf16 gradients left on the parameters"
    assert all(not torch.equal(a, b) for a, b in zip(before, opt.masters, strict=True)), "a master did not move"
    with float32_params(opt):
        model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, "float32_params did not restore bf16"
    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    names = [n for n, _ in model.named_parameters()]
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert all(torch.equal(saved[n], m) for n, m in zip(names, opt.masters, strict=True))


@pytest.fixture(scope="module")
def policy_and_table(tmp_path_factory) -> dict:
    return policy_and_advantages(tmp_path_factory.mktemp("master"), tie_word_embeddings=True)


def test_checkpoint_is_float32_and_resume_is_bit_identical(policy_and_table) -> None:
    """Iteration 1 from the fp32_master checkpoint of iteration 0: on a fresh worker (a resume: masters and
    AdamW state from disk) and on the worker that wrote it (uninterrupted: its resident masters) -> equal bits.
    Each update is 2 optimizer steps (2 prompts, 1 per mini-batch)."""
    from stages.workers.actor_worker import ActorWorker

    threads = torch.get_num_threads()
    actor = {"ppo_mini_batch_size": 1, "ppo_micro_batch_size": 2, "num_workers": 1, "optim": {"lr": 1e-3}}
    actor["mixed_precision"] = {"param_dtype": "bfloat16", "master_weights": "fp32_master"}
    ctx = policy_and_table
    try:
        first = ActorWorker(0, 1, threads)
        first.update(update_request(ctx, "v1", actor))
        out0 = ctx["root"] / "v1"
        w1, opt1, _ = load_out(out0)
        assert {t.dtype for t in w1.values()} == {torch.float32}, "the checkpoint is not float32"
        assert {t.dtype for s in opt1["optimizer"]["state"].values() for t in s.values()} == {torch.float32}
        uninterrupted = first.update(update_request(ctx, "v2_resident", actor, out0))
        assert first.resident is not None and first.resident.master_weights == "fp32_master"
        resumed = ActorWorker(0, 1, threads).update(update_request(ctx, "v2_resumed", actor, out0))
    finally:
        torch.set_num_threads(threads)
    assert uninterrupted["actor/weights_loaded_from_disk"] == 0.0 and resumed["actor/weights_loaded_from_disk"] == 1.0
    (wa, oa, _), (wb, ob, _) = load_out(ctx["root"] / "v2_resident"), load_out(ctx["root"] / "v2_resumed")
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
        assert not torch.equal(wa[k], w1[k]), f"{k} did not change in the second update"
    for i, s in oa["optimizer"]["state"].items():
        assert all(torch.equal(t, ob["optimizer"]["state"][i][k]) for k, t in s.items()), i


def test_invalid_master_weight_combinations_say_what_why_fix() -> None:
    with pytest.raises(ValueError, match=r"'fp32_master' needs param_dtype='bfloat16' \(got 'float32'\).*set actor"):
        ActorConfig(mixed_precision={"param_dtype": "float32", "master_weights": "fp32_master"})
    mp = {"param_dtype": "bfloat16", "master_weights": "fp32_master"}
    with pytest.raises(ValueError, match="not supported with actor.lora.rank=8, because .*; use master_weights"):
        ActorConfig(mixed_precision=mp, lora={"rank": 8})
    with pytest.raises(ValueError, match="not supported with actor.strategy='megatron', because .*DistributedOptim"):
        ActorConfig(strategy="megatron", mixed_precision=mp)
    with pytest.raises(ValueError, match="master_weights"):
        ActorConfig(mixed_precision={"param_dtype": "bfloat16", "master_weights": "bf16"})
    assert ActorConfig(strategy="fsdp", mixed_precision=mp).mixed_precision.master_weights == "fp32_master"


def test_two_ranks_torch_and_fsdp_fp32_master_agree(policy_and_table) -> None:
    """2 gloo ranks, 2 optimizer steps x 2 micro-batches: torch fp32_master (its own float32 all-reduce of the
    master gradients, no DDP) against fsdp fp32_master (FSDP2's bf16 all-gather over float32 shards, float32
    reduce-scatter). Both compute with bf16(M) and average float32 gradients; they differ in the order of the
    sums (per-tensor vs per-shard norm, accumulation before vs after the reduction), so close, not equal
    (weights atol 1e-6 [measured max 1.2e-7], pg_loss rel 1e-5 [0]); both float32 on disk and different from
    the autocast update (which computes with float32 embeddings and norm weights)."""
    from tests.stages.helpers_backend_update import spawn_update

    actor = {"num_workers": 2, "ppo_mini_batch_size": 1, "ppo_micro_batch_size": 2, "optim": {"lr": 1e-3}}
    bf16 = {"param_dtype": "bfloat16"}
    outs = {}
    for name, strategy, mp in (
        ("torch", "torch", {**bf16, "master_weights": "fp32_master"}),
        ("fsdp", "fsdp", {**bf16, "master_weights": "fp32_master"}),
        ("autocast", "torch", bf16),
    ):
        req = update_request(policy_and_table, f"dp2_{name}", {**actor, "strategy": strategy, "mixed_precision": mp})
        outs[name] = load_out(spawn_update(req, 2))
    (wt, ot, mt), (wf, of, mf) = outs["torch"], outs["fsdp"]
    assert {t.dtype for t in [*wt.values(), *wf.values()]} == {torch.float32}
    for i, s in ot["optimizer"]["state"].items():  # both in the torch backend's layout, float32
        for m in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(of["optimizer"]["state"][i][m], s[m], atol=1e-7, rtol=1e-5)
    for k in wt:
        torch.testing.assert_close(wf[k], wt[k], atol=FSDP_ATOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    assert mf["actor/pg_loss"] == pytest.approx(mt["actor/pg_loss"], rel=1e-5)
    wa = outs["autocast"][0]
    assert any(not torch.equal(wa[k], wt[k]) for k in wt), "fp32_master equals autocast: bf16 params not used"
