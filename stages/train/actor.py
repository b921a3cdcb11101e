"""Torch policy-optimization backend: PPO-clip epochs over mini-batches with micro-batch
gradient accumulation, data parallel over a torch.distributed (gloo) group when one exists.

Runs without Ray (unit tests call `ppo_update` directly); stages.update runs it on the run's
persistent gloo worker group. Old log-probs are recomputed by the policy before the first optimizer step (verl's
`compute_log_prob`), so the PPO ratio is exactly 1 at the first micro-batch.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from stages.algos.kl import compute_kl_penalty
from stages.algos.losses import entropy_from_logits, gather_logprobs, get_policy_loss_fn, masked_mean
from stages.train.batching import pad_rollouts, response_logits, token_advantages


def _slice(batch: dict, idx: Tensor) -> dict:
    return {k: (v[idx] if isinstance(v, Tensor) else v) for k, v in batch.items()}


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@torch.no_grad()
def compute_logprobs(model, batch: dict, micro_batch_size: int, temperature: float = 1.0) -> Tensor:
    """Log-probs of the response tokens under `model` at `temperature`: (N, L)."""
    out = []
    n = batch["input_ids"].shape[0]
    for s in range(0, n, micro_batch_size):
        mb = _slice(batch, torch.arange(s, min(s + micro_batch_size, n)))
        out.append(gather_logprobs(response_logits(model, mb, temperature), mb["responses"]))
    return torch.cat(out)


def make_optimizer(model, optim_cfg) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(model.parameters(), lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                            weight_decay=optim_cfg.weight_decay)
    warm = optim_cfg.lr_warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0)
    return opt, sched


def clip_grads(model, clip: float) -> Tensor:
    """Global-norm gradient clipping over the parameters that got a gradient (clip <= 0: measure only)."""
    params = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))


def optimizer_step(optimizer, scheduler, grad_norm: Tensor, add, *, prefix: str, error: str) -> None:
    """One optimizer + LR-scheduler step after the gradients of a mini-batch are final: refuses a
    non-finite grad norm (`error` is the message, with {norm}), logs <prefix>/grad_norm and <prefix>/lr."""
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(error.format(norm=float(grad_norm)))
    add(f"{prefix}/grad_norm", float(grad_norm))
    add(f"{prefix}/lr", optimizer.param_groups[0]["lr"])
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


ACTOR_GRAD_ERROR = "non-finite grad norm {norm} at update; lower actor.optim.lr or check the advantages table"


def ppo_update(model, optimizer, scheduler, rows: dict, actor_cfg, *, n_per_prompt: int,
               pad_id: int, seed: int = 0, ddp_model=None, temperature: float = 1.0) -> dict[str, float]:
    """One iteration's policy optimization on this worker's share of the batch.

    Args:
        rows: prompt_token_ids (list of N lists), response_token_ids (N lists), advantages (N,)
            float tensor, optional ref_logprobs (N lists). N is this worker's rollouts; they are
            split into ppo_epochs x (mini-batches of ppo_mini_batch_size * n / world) rollouts.
        ddp_model: the DistributedDataParallel wrapper when world > 1 (model is its .module).
        temperature: logits are divided by it for old/new log-probs and the entropy (verl: the
            rollout's sampling temperature, so the PPO ratio compares the distributions that sampled).
    Returns:
        metrics averaged over micro-batches (and workers): actor/pg_loss, actor/pg_clipfrac, ...
    """
    rank, world = _world()
    train_model = ddp_model or model
    batch = pad_rollouts(rows["prompt_token_ids"], rows["response_token_ids"], pad_id)
    n = batch["input_ids"].shape[0]
    batch["advantages"] = token_advantages(rows, batch["response_mask"])  # (N, L)
    mb_size = actor_cfg.ppo_micro_batch_size
    model.eval()
    batch["old_logprobs"] = compute_logprobs(model, batch, mb_size, temperature)
    if actor_cfg.use_kl_loss:
        if "ref_logprobs" not in rows:
            raise ValueError("actor.use_kl_loss=True needs ref_logprobs in the batch; enable the "
                             "reference log-prob stage or set actor.use_kl_loss=False.")
        batch["ref_logprobs"] = torch.zeros_like(batch["response_mask"])  # (N, L)
        for i, r in enumerate(rows["ref_logprobs"]):
            batch["ref_logprobs"][i, :len(r)] = torch.as_tensor(r, dtype=torch.float32)
    model.train()
    per_worker_mini = actor_cfg.ppo_mini_batch_size * n_per_prompt // world
    assert n % per_worker_mini == 0, f"{n=} rollouts not divisible into mini-batches of {per_worker_mini}"
    low = actor_cfg.clip_ratio_low if actor_cfg.clip_ratio_low is not None else actor_cfg.clip_ratio
    high = actor_cfg.clip_ratio_high if actor_cfg.clip_ratio_high is not None else actor_cfg.clip_ratio
    policy_loss = get_policy_loss_fn(actor_cfg.policy_loss.loss_mode)
    gen = torch.Generator().manual_seed(seed)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value
        counts[key] = counts.get(key, 0) + 1

    for _ in range(actor_cfg.ppo_epochs):
        order = torch.randperm(n, generator=gen)
        for m0 in range(0, n, per_worker_mini):
            mini = order[m0:m0 + per_worker_mini]
            n_micro = math.ceil(len(mini) / mb_size)
            for k in range(n_micro):
                mb = _slice(batch, mini[k * mb_size:(k + 1) * mb_size])
                sync = k == n_micro - 1 or ddp_model is None
                ctx = torch.enable_grad() if sync else train_model.no_sync()
                with ctx:
                    logits = response_logits(train_model, mb, temperature)  # (n_mb, L, V)
                    logprobs = gather_logprobs(logits, mb["responses"])  # (n_mb, L)
                    pg_loss, m = policy_loss(
                        mb["old_logprobs"], logprobs, mb["advantages"], mb["response_mask"],
                        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=actor_cfg.clip_ratio_c,
                        loss_agg_mode=actor_cfg.loss_agg_mode)
                    entropy = masked_mean(entropy_from_logits(logits), mb["response_mask"])
                    loss = pg_loss - actor_cfg.entropy_coeff * entropy
                    if actor_cfg.use_kl_loss:
                        kl = masked_mean(compute_kl_penalty(logprobs, mb["ref_logprobs"],
                                                            actor_cfg.kl_loss_type), mb["response_mask"])
                        loss = loss + actor_cfg.kl_loss_coef * kl
                        add("actor/kl_loss", float(kl))
                    (loss / n_micro).backward()
                for key, value in m.items():
                    add(key, value)
                add("actor/entropy", float(entropy.detach()))
            grad_norm = clip_grads(model, actor_cfg.optim.grad_clip)
            optimizer_step(optimizer, scheduler, grad_norm, add, prefix="actor", error=ACTOR_GRAD_ERROR)
    model.eval()
    metrics = {k: sums[k] / counts[k] for k in sorted(sums)}
    if world > 1:
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        metrics = {k: float(v) / world for k, v in zip(keys, t)}
    metrics["actor/num_rollouts"] = float(n * world)
    return metrics
