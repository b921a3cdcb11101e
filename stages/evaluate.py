"""Validation: greedy pass@1 and sampled mean@k of a policy on the held-out prompts.

The rollouts run on the run's "rollout" worker group (stages.rollout.generate_rollouts), the same
engines as training; scoring runs in this process.
"""

from __future__ import annotations

import pandas as pd

from configs.schema import RunConfig
from stages import seeds
from stages.metrics import validation_metrics
from stages.prompt_batch import prompt_batch_frame
from stages.reward import score_rollouts
from stages.rollout import generate_rollouts
from stages.workers.placement import GpuPool


def validation_rollouts(
    model_dir: str, val_prompts: pd.DataFrame, tokenizer, cfg: RunConfig, *, use_ray: bool = True
) -> dict[str, pd.DataFrame]:
    """Scored validation rollouts of the first data.val_batch_size val prompts: "greedy" (one per
    prompt) and "sampled" (rollout.n per prompt)."""
    batch = prompt_batch_frame(val_prompts.head(cfg.data.val_batch_size), tokenizer, cfg.data.max_prompt_length)
    batch = batch.assign(group_id=batch["prompt_id"], policy_version=-1)
    out: dict[str, pd.DataFrame] = {}
    for mode, n in (("greedy", 1), ("sampled", cfg.rollout.n)):
        rollouts = generate_rollouts(
            batch,
            model_dir=model_dir,
            rollout_cfg=cfg.rollout,
            max_tokens=cfg.data.max_response_length,
            seed=seeds.validation(cfg.rollout.seed),
            greedy=mode == "greedy",
            n=n,
            use_ray=use_ray,
            gpus=GpuPool.of(cfg.trainer),
        )
        out[mode] = score_rollouts(rollouts, cfg.reward, use_ray=False)
    return out


def validation_summary(scored: dict[str, pd.DataFrame], n: int) -> dict[str, float]:
    """val-core/<ds>/reward/mean@1 (greedy), val-aux/<ds>/reward/mean@<n> (sampled) and
    val/response_length/<tag>, from validation_rollouts' output; n = rollout.n."""
    metrics: dict[str, float] = {}
    for mode, tag in (("greedy", "mean@1"), ("sampled", f"mean@{n}")):
        m = validation_metrics(scored[mode], tag)
        if mode == "sampled":
            m = {k.replace("val-core/", "val-aux/"): v for k, v in m.items()}
        metrics |= m
        metrics[f"val/response_length/{tag}"] = float(scored[mode]["response_length"].mean())
    return metrics


def validate_policy(
    model_dir: str, val_prompts: pd.DataFrame, tokenizer, cfg: RunConfig, *, use_ray: bool = True
) -> dict[str, float]:
    """Metrics val-core/<ds>/reward/mean@1 (greedy) and val-aux/<ds>/reward/mean@<n> (sampled)."""
    return validation_summary(
        validation_rollouts(model_dir, val_prompts, tokenizer, cfg, use_ray=use_ray), cfg.rollout.n
    )
