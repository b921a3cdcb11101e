"""Validation: a greedy pass and (rollout.val_kwargs.do_sample) n sampled responses per held-out prompt.

Metrics (stages.iteration_metrics.validation_metrics, verl's process_validation_metrics and names): the greedy
pass gives val-core/<ds>/reward/mean@1 (what verl's default val_kwargs, n=1 and do_sample=false, give); the sampled pass
gives mean@n, std@n, best@K/worst@K (and maj@K when the scorer returns a pred) split into val-core/ and val-aux/
as verl splits them. The rollouts run on the run's "rollout" worker group (stages.rollouts.generate_rollouts), the same
engines as training; scoring runs in this process.
"""

from __future__ import annotations

import pandas as pd

from configs.schema import RunConfig
from stages import seeds
from stages.iteration_metrics import validation_metrics
from stages.prompt_batches import prompt_batch_frame
from stages.rollouts import generate_rollouts
from stages.scored_rollouts import score_rollouts
from stages.workers.placement import GpuPool


def validation_rollouts(
    model_dir: str, val_prompts: pd.DataFrame, tokenizer, cfg: RunConfig, *, use_ray: bool = True
) -> dict[str, pd.DataFrame]:
    """Scored validation rollouts of the first data.val_batch_size val prompts: "greedy" (one per
    prompt) and, when rollout.val_kwargs samples (ValKwargsConfig.sampled_n > 0), "sampled" (n per prompt,
    with val_kwargs' temperature/top_p/top_k where set)."""
    batch = prompt_batch_frame(val_prompts.head(cfg.data.val_batch_size), tokenizer, cfg.data.max_prompt_length)
    batch = batch.assign(group_id=batch["prompt_id"], policy_version=-1)
    vk = cfg.rollout.val_kwargs
    sampling = {k: v for k, v in vk.model_dump(include={"temperature", "top_p", "top_k"}).items() if v is not None}
    n_sampled = vk.sampled_n(cfg.rollout.n)
    out: dict[str, pd.DataFrame] = {}
    for mode, n in (("greedy", 1), ("sampled", n_sampled))[: 2 if n_sampled else 1]:
        rollouts = generate_rollouts(
            batch,
            model_dir=model_dir,
            rollout_cfg=cfg.rollout.model_copy(update=sampling),
            max_tokens=cfg.data.max_response_length,
            seed=seeds.validation(cfg.rollout.seed),
            greedy=mode == "greedy",
            n=n,
            use_ray=use_ray,
            gpus=GpuPool.of(cfg.trainer),
        )
        out[mode] = score_rollouts(rollouts, cfg.reward, use_ray=False)
    return out


def validation_summary(scored: dict[str, pd.DataFrame]) -> dict[str, float]:
    """The metrics of validation_rollouts' output: each pass's val-core/... and val-aux/... (verl's names) and
    val/response_length/mean@<n> (n = 1 greedy, n sampled)."""
    metrics: dict[str, float] = {}
    for rollouts in scored.values():
        n = int(rollouts.groupby("prompt_id").size().max())
        metrics |= validation_metrics(rollouts)
        metrics[f"val/response_length/mean@{n}"] = float(rollouts["response_length"].mean())
    return metrics


def validate_policy(
    model_dir: str, val_prompts: pd.DataFrame, tokenizer, cfg: RunConfig, *, use_ray: bool = True
) -> dict[str, float]:
    """validation_summary of validation_rollouts: val-core/<ds>/reward/mean@1 (greedy), the sampled pass's."""
    return validation_summary(validation_rollouts(model_dir, val_prompts, tokenizer, cfg, use_ray=use_ray))
