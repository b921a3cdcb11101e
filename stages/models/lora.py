"""LoRA policies (actor.lora, peft): wrap, merge, save and reload adapters over a frozen base checkpoint.

Choices:
- Only the adapter matrices A (r, in) and B (out, r) train; every base parameter has requires_grad=False, so
  the optimizer (stages.train.optim.make_optimizer) holds the adapters alone.
- A checkpoint of a LoRA policy holds the MERGED weights W + B @ A * alpha / r in plain HF format (so rollout
  engines, their in-place weight sync and fingerprint, the reference model and `rlake export` read it as any
  policy), plus LORA_DIR: the peft adapter (adapter_config.json, adapter_model.safetensors) and BASE_FILE naming
  the base checkpoint the adapter sits on (its path or checkpoint reference and its weights' fingerprint).
  Resuming loads that base and the adapter, never the merged weights, so no rounding of W + dW - dW accumulates.
- Merging is computed into a new state dict (peft's get_delta_weight), never merged and unmerged in place.
- A is initialised from INIT_SEED (B is zero, so version 0's merged weights equal the base), whichever call
  loads the policy first: replays and resumed runs start from the same adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

from configs.schema import LoraConfig
from stages.io.checkpoints import resolve_model_dir
from stages.models.fingerprint import fingerprint_checkpoint
from stages.models.policy import load_policy

LORA_DIR = "lora_adapter"
"""Subdirectory of a policy checkpoint with the peft adapter; absent in a full fine-tuning checkpoint."""
BASE_FILE = "rlake_base.json"
"""In LORA_DIR: {"base_policy": path or checkpoint reference, "base_fingerprint": ..., "base_name": dir name}."""
INIT_SEED = 0
ADAPTER = "default"


def apply_lora(model, lora_cfg: LoraConfig) -> PeftModel:
    """`model` wrapped in fresh LoRA adapters (B = 0) per actor.lora; only the adapters require grad."""
    cfg = PeftLoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        return get_peft_model(model, cfg)


def is_lora(model) -> bool:
    return isinstance(model, PeftModel)


def _hf_name(name: str) -> str:
    """A peft-wrapped base model's parameter name as the plain HF model names it."""
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The plain HF state dict of base + adapters: W + B @ A * alpha / r for every adapted layer (detached
    copies; the model is not modified)."""
    base = model.get_base_model()
    deltas = {
        f"{name}.weight": module.get_delta_weight(ADAPTER)
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A
    }
    out: dict[str, torch.Tensor] = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        hf = _hf_name(name)
        delta = deltas.get(hf)
        out[hf] = (tensor + delta.to(tensor.dtype)) if delta is not None else tensor.detach().clone()
    return out


def save_merged(model, tokenizer, path: Path, state: dict[str, torch.Tensor]) -> None:
    """Write the merged HF checkpoint `state` of the LoRA policy `model` (config from its base model)."""
    path.mkdir(parents=True, exist_ok=True)
    model.get_base_model().save_pretrained(path, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(path)


def save_adapter(model: PeftModel, path: Path, base: dict) -> None:
    """peft's adapter files and BASE_FILE (`base`: where the adapter's base checkpoint is) in path/LORA_DIR."""
    out = path / LORA_DIR
    model.save_pretrained(out)
    (out / BASE_FILE).write_text(json.dumps(base, indent=1, sort_keys=True))


def base_record(policy_dir: str | Path) -> dict:
    """BASE_FILE contents for the checkpoint `policy_dir` (a path or checkpoint reference) used as a base."""
    local = resolve_model_dir(policy_dir)
    return {
        "base_policy": str(policy_dir),
        "base_name": Path(local).name,
        "base_fingerprint": fingerprint_checkpoint(local),
    }


def adapter_base(ckpt_dir: Path) -> dict | None:
    """BASE_FILE of the LoRA checkpoint at ckpt_dir (a local dir), or None for a full-weights checkpoint."""
    f = ckpt_dir / LORA_DIR / BASE_FILE
    return json.loads(f.read_text()) if f.is_file() else None


def _find_base(ckpt_dir: Path, base: dict) -> Path:
    """The base checkpoint's local directory: as recorded, or (a moved output directory) the sibling of
    ckpt_dir with the recorded name; checked against the recorded fingerprint."""
    recorded = str(base["base_policy"])
    candidates = [ckpt_dir.parent / base["base_name"]]
    if recorded.startswith("rlake-checkpoint:") or Path(recorded).is_dir():
        candidates.insert(0, resolve_model_dir(recorded))
    for cand in candidates:
        if (cand / "config.json").is_file() and fingerprint_checkpoint(cand) == base["base_fingerprint"]:
            return cand
    raise FileNotFoundError(
        f"LoRA checkpoint '{ckpt_dir}' sits on base '{recorded}' (fingerprint {base['base_fingerprint']}), which is "
        f"neither there nor next to it as '{base['base_name']}' with that fingerprint; restore the base checkpoint "
        "(policy_v0 is never pruned), or start a new run from this checkpoint's merged weights (`rlake export`)."
    )


def _check_matches(ckpt_dir: Path, lora_cfg: LoraConfig) -> None:
    """A LoRA checkpoint resumes only under the adapter shape it was trained with."""
    saved = json.loads((ckpt_dir / LORA_DIR / "adapter_config.json").read_text())
    targets = saved["target_modules"]
    want = lora_cfg.target_modules
    same_targets = want == "all-linear" or sorted(want) == sorted(targets if isinstance(targets, list) else [targets])
    if lora_cfg.rank != saved["r"] or float(lora_cfg.alpha) != float(saved["lora_alpha"]) or not same_targets:
        raise ValueError(
            f"checkpoint '{ckpt_dir}' holds a LoRA adapter of rank {saved['r']}, alpha {saved['lora_alpha']} on "
            f"{targets}, but actor.lora is rank {lora_cfg.rank}, alpha {lora_cfg.alpha} on {want}; its optimizer "
            "state and adapter fit only the former: set actor.lora to the checkpoint's values to resume it."
        )


def load_lora_policy(policy_dir: str | Path, lora_cfg: LoraConfig):
    """(peft model, tokenizer, base record) for training from the checkpoint policy_dir (path or reference):
    its base + its adapter when it is a LoRA checkpoint, else policy_dir itself + fresh adapters."""
    local = resolve_model_dir(policy_dir)
    base = adapter_base(local)
    if base is None:
        model, tok = load_policy(local)
        return apply_lora(model, lora_cfg), tok, base_record(policy_dir)
    _check_matches(local, lora_cfg)
    model, tok = load_policy(_find_base(local, base))
    model = apply_lora(model, lora_cfg)
    set_peft_model_state_dict(model, load_file(str(local / LORA_DIR / "adapter_model.safetensors")))
    return model, tok, base


def refuse_lora_checkpoint(policy_dir: str | Path) -> None:
    """A full fine-tuning update cannot continue a LoRA checkpoint: its optimizer state is the adapters'."""
    local = resolve_model_dir(policy_dir)
    if adapter_base(local) is not None:
        raise ValueError(
            f"checkpoint '{policy_dir}' was trained with LoRA (it has {LORA_DIR}/) but actor.lora.rank is 0; "
            "its optimizer state holds only the adapters: set actor.lora as the run that wrote it did to resume, "
            "or `rlake export` it and start a new full fine-tuning run with model.path=<export dir>."
        )
