"""Initial policy (version 0): the tiny model warm-started in-process, or a local HF checkpoint."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from stages.io.checkpoints import atomic_dir
from stages.models.policy import load_policy, save_policy
from stages.models.smollm2 import resolve_model_path
from stages.models.tiny import build_char_tokenizer, build_tiny_model, warmstart_sft


def _warmstarted_tiny(model_cfg, train_prompts: pd.DataFrame, *, seed: int) -> tuple:
    """(model, tokenizer, warm-start metadata) of the tiny model after its SFT on the train prompts."""
    tok = build_char_tokenizer()
    model = build_tiny_model(model_cfg.tiny, len(tok), seed=seed)
    formats = model_cfg.tiny.warmstart_answer_formats
    examples = [
        (list(p), formats[i % len(formats)].format(answer=rm["ground_truth"]))
        for i, (p, rm) in enumerate(zip(train_prompts["prompt"], train_prompts["reward_model"], strict=True))
    ]
    losses = warmstart_sft(model, tok, examples, model_cfg.tiny, seed=seed)
    meta = (
        {"warmstart_first_loss": losses[0], "warmstart_last_loss": losses[-1], "warmstart_steps": len(losses)}
        if losses
        else {}
    )
    return model, tok, meta


def create_initial_policy(model_cfg, train_prompts: pd.DataFrame, out_dir: str | Path, *, seed: int) -> dict:
    """Write policy version 0 to out_dir (whole or not at all: atomic_dir); returns metadata (params,
    warm-start loss)."""
    meta: dict = {"source": model_cfg.path}
    with atomic_dir(out_dir) as tmp:
        if model_cfg.path == "tiny":
            model, tok, warm = _warmstarted_tiny(model_cfg, train_prompts, seed=seed)
            meta |= warm
        else:
            src = Path(resolve_model_path(model_cfg.path))
            model, tok = load_policy(src, model_cfg.dtype)  # validates it loads before copying
        save_policy(model, tok, tmp)
    meta["num_parameters"] = int(sum(p.numel() for p in model.parameters()))
    return meta
