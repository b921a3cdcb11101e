"""Initial policy (version 0): the tiny model warm-started in-process, or a local HF checkpoint."""
from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd

from stages.models.policy import load_policy, save_policy

from stages.models.tiny import build_char_tokenizer, build_tiny_model, warmstart_sft


def create_initial_policy(model_cfg, train_prompts: pd.DataFrame, out_dir: str | Path, *, seed: int) -> dict:
    """Write policy version 0 to out_dir; returns metadata (params, warm-start loss)."""
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    meta: dict = {"source": model_cfg.path}
    if model_cfg.path == "tiny":
        tok = build_char_tokenizer()
        model = build_tiny_model(model_cfg.tiny, len(tok), seed=seed)
        formats = model_cfg.tiny.warmstart_answer_formats
        examples = [(list(p), formats[i % len(formats)].format(answer=rm["ground_truth"])) for i, (p, rm) in
                    enumerate(zip(train_prompts["prompt"], train_prompts["reward_model"]))]
        losses = warmstart_sft(model, tok, examples, model_cfg.tiny, seed=seed)
        if losses:
            meta |= {"warmstart_first_loss": losses[0], "warmstart_last_loss": losses[-1], "warmstart_steps": len(losses)}
        save_policy(model, tok, tmp)
    else:
        from stages.models.smollm2 import resolve_model_path

        src = Path(resolve_model_path(model_cfg.path))
        model, tok = load_policy(src, model_cfg.dtype)  # validates it loads before copying
        save_policy(model, tok, tmp)
    meta["num_parameters"] = int(sum(p.numel() for p in model.parameters()))
    tmp.rename(out)
    return meta
