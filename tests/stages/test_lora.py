"""LoRA policies (stages/models/lora.py): what trains, what the optimizer holds, what a checkpoint holds, and the
merge W + B @ A * alpha / r checked against numbers derived by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from configs.schema import LoraConfig, OptimConfig, load_config
from stages.models import lora
from stages.models.policy import load_policy
from stages.train.optim import make_optimizer
from stages.workers.actor_worker import load_resident

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
Q = "model.layers.0.self_attn.q_proj.weight"


def _lora_policy(tiny_checkpoint, **kw):
    cfg = LoraConfig(**{"rank": 2, "alpha": 4.0, "target_modules": ["q_proj", "v_proj"], **kw})
    return lora.load_lora_policy(str(tiny_checkpoint), cfg)


def test_only_the_adapters_train_and_sit_in_the_optimizer(tiny_checkpoint) -> None:
    model, _, base = _lora_policy(tiny_checkpoint)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"q_proj", "v_proj"}
    opt, _ = make_optimizer(model, OptimConfig(lr=0.1))
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if n in trainable}
    assert base["base_policy"] == str(tiny_checkpoint) and base["base_name"] == "policy_v0"


def test_fresh_adapters_leave_the_base_weights_unchanged(tiny_checkpoint) -> None:
    model, _, _ = _lora_policy(tiny_checkpoint)
    plain, _ = load_policy(tiny_checkpoint)
    merged = lora.merged_state_dict(model)
    assert merged.keys() == plain.state_dict().keys()  # plain HF names, no adapter tensors
    for name, w in plain.state_dict().items():
        assert torch.equal(merged[name], w), name  # B starts at zero


@torch.no_grad()
def test_merged_weight_is_base_plus_b_a_times_alpha_over_rank(tiny_checkpoint) -> None:
    model, _, _ = _lora_policy(tiny_checkpoint)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # (r=2, in), (out, r=2)
    a.zero_()
    b.zero_()
    a[0, 0], a[1, 1] = 1.0, 1.0
    b[0, 0], b[1, 1] = 0.5, -0.25
    # B @ A is zero but for (0,0) = 0.5 * 1 and (1,1) = -0.25 * 1; scaling alpha / r = 4 / 2 = 2, so the merged
    # q_proj is W + 1.0 at (0,0), W - 0.5 at (1,1), W elsewhere.
    want = load_policy(tiny_checkpoint)[0].state_dict()[Q].clone()
    want[0, 0] += 1.0
    want[1, 1] -= 0.5
    assert torch.equal(lora.merged_state_dict(model)[Q], want)
    x = torch.randn(3, a.shape[1])
    assert torch.allclose(layer(x), x @ want.T + layer.base_layer.bias, atol=1e-6)  # the forward uses it too


def _train_step(model) -> None:
    opt, _ = make_optimizer(model, OptimConfig(lr=0.05))
    model.train()
    ids = torch.arange(1, 9).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()


def test_checkpoint_holds_merged_weights_and_the_adapter_and_resumes(tiny_checkpoint, tmp_path) -> None:
    model, tok, base = _lora_policy(tiny_checkpoint)
    _train_step(model)
    _train_step(model)  # B moved away from zero
    ckpt = tmp_path / "policy_v1"
    merged = lora.merged_state_dict(model)
    lora.save_merged(model, tok, ckpt, merged)
    lora.save_adapter(model, ckpt, base)
    assert json.loads((ckpt / lora.LORA_DIR / lora.BASE_FILE).read_text()) == base
    plain, _ = load_policy(ckpt)  # a plain HF model: what engines and `rlake export` read
    assert not torch.equal(plain.state_dict()[Q], load_policy(tiny_checkpoint)[0].state_dict()[Q])
    cfg = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])
    res = load_resident(str(ckpt), OptimConfig(), lora=cfg)  # resume: base + adapter, not the merged weights
    assert res.lora_base == base and lora.is_lora(res.model)
    again = lora.merged_state_dict(res.model)
    for name, w in merged.items():
        assert torch.equal(again[name], w), name
    ids = torch.arange(1, 9).unsqueeze(0)
    assert torch.allclose(res.model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5)


def test_moved_base_is_found_next_to_the_checkpoint(tiny_checkpoint, tmp_path) -> None:
    model, tok, base = _lora_policy(tiny_checkpoint)
    run = tmp_path / "moved"
    shutil.copytree(tiny_checkpoint, run / "policy_v0")
    lora.save_merged(model, tok, run / "policy_v1", lora.merged_state_dict(model))
    lora.save_adapter(model, run / "policy_v1", {**base, "base_policy": str(tmp_path / "gone" / "policy_v0")})
    loaded, _, _ = lora.load_lora_policy(
        str(run / "policy_v1"), LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])
    )
    assert lora.is_lora(loaded)


def test_mismatched_settings_and_full_fine_tuning_refuse_a_lora_checkpoint(tiny_checkpoint, tmp_path) -> None:
    model, tok, base = _lora_policy(tiny_checkpoint)
    ckpt = tmp_path / "policy_v1"
    lora.save_merged(model, tok, ckpt, lora.merged_state_dict(model))
    lora.save_adapter(model, ckpt, base)
    with pytest.raises(ValueError, match=r"holds a LoRA adapter of rank 2.*set actor.lora to the checkpoint's"):
        lora.load_lora_policy(str(ckpt), LoraConfig(rank=4, alpha=4.0, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"was trained with LoRA .* actor.lora.rank is 0"):
        load_resident(str(ckpt), OptimConfig())


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_lora_with_a_sharded_strategy_is_a_config_error(strategy: str) -> None:
    with pytest.raises(ValueError, match=rf"actor.lora.rank=8 is not supported with actor.strategy='{strategy}'"):
        load_config(CONFIGS / "ci_tiny_lora.yaml", [f"actor.strategy={strategy}"])


def test_verl_lora_names_map_to_actor_lora() -> None:
    cfg = load_config(
        CONFIGS / "ci_tiny.yaml",
        [
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.model.target_modules=[q_proj]",
        ],
    )
    assert (cfg.actor.lora.rank, cfg.actor.lora.alpha, cfg.actor.lora.target_modules) == (4, 8.0, ["q_proj"])
