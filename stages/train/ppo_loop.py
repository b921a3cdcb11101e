"""The one PPO optimization loop, shared by the torch actor (stages.train.actor), the critic
(stages.train.critic) and the Megatron actor (stages.train.megatron.ppo), and their per-micro-batch losses.

Schedule (verl's): an update makes `epochs` passes over this worker's N rollouts. Each pass draws one
permutation from a generator seeded with the update's seed and cuts it into mini-batches (one optimizer
step each) of micro-batches (one forward/backward each). A micro-batch's loss is divided by the number of
micro-batches of its mini-batch, so the accumulated gradient is their mean; then the gradients are
finished (clipped; Megatron also reduces them over its groups) and one optimizer step is taken.
Metrics are means over micro-batches (losses) or optimizer steps (grad_norm, lr), then over the
data-parallel workers.

Shape legend: n_mb rollouts of a micro-batch, L response len, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from stages.algos.kl import compute_kl_penalty
from stages.algos.losses import entropy_from_logits, gather_logprobs, get_policy_loss_fn, masked_mean
from stages.algos.value import compute_value_loss
from stages.train.batching import select_rows
from stages.train.optim import optimizer_step


class MetricAccumulator:
    """Running sums and counts per metric key; `means()` averages each over the values it was given."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value
        self.counts[key] = self.counts.get(key, 0) + 1

    def add_all(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.add(key, value)

    def means(self) -> dict[str, float]:
        """{key: mean}, keys sorted."""
        return {k: self.sums[k] / self.counts[k] for k in sorted(self.sums)}


def mean_over_workers(metrics: dict[str, float], world: int, group=None) -> dict[str, float]:
    """Each metric averaged over the `world` ranks of a torch.distributed group (default: the whole group)."""
    if world <= 1:
        return metrics
    keys = sorted(metrics)
    t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return {k: float(v) / world for k, v in zip(keys, t, strict=True)}


def minibatches(n: int, per_worker_mini: int, epochs: int, generator: torch.Generator) -> Iterator[Tensor]:
    """Row indices of each mini-batch: per epoch one permutation of range(n) from `generator`, cut in order."""
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for m0 in range(0, n, per_worker_mini):
            yield order[m0 : m0 + per_worker_mini]


def ppo_loop(
    n: int,
    *,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int,
    seed: int,
    backward: Callable[[list[Tensor]], None],
    finish_grads: Callable[[], Tensor],
    optimizer,
    scheduler,
    metrics: MetricAccumulator,
    prefix: str,
    error: str,
) -> None:
    """The optimizer steps of one update over n rollouts (see the module docstring).

    backward(micro-batches) runs forward/backward of one mini-batch, given as the row indices of each of
    its micro-batches (micro_batch_size rows, the last one may be smaller), each loss divided by their
    number; finish_grads() makes the gradients final and returns the global grad norm; then one
    optimizer_step (error: the message of a non-finite norm, prefix: of the grad_norm and lr metrics)."""
    gen = torch.Generator().manual_seed(seed)
    for mini in minibatches(n, mini_batch_size, epochs, gen):
        backward(list(mini.split(micro_batch_size)))
        grad_norm = finish_grads()
        optimizer_step(optimizer, scheduler, grad_norm, metrics.add, prefix=prefix, error=error)


def accumulate_grads(
    batch: dict,
    micro_idx: list[Tensor],
    loss_fn: Callable[[dict], tuple[Tensor, dict]],
    metrics: MetricAccumulator,
    *,
    no_sync: Callable | None = None,
) -> None:
    """The torch `backward` of ppo_loop: loss_fn(micro-batch) -> (loss, metrics) on each micro-batch of
    `batch`, (loss / n_micro).backward(). no_sync: DDP's context manager, so that the gradients are
    all-reduced once, at the last micro-batch."""
    n_micro = len(micro_idx)
    for k, idx in enumerate(micro_idx):
        mb = select_rows(batch, idx)
        ctx = no_sync() if no_sync is not None and k < n_micro - 1 else torch.enable_grad()
        with ctx:
            loss, m = loss_fn(mb)
            (loss / n_micro).backward()
        metrics.add_all(m)


def clip_bounds(actor_cfg) -> tuple[float, float]:
    """(clip_ratio_low, clip_ratio_high), each defaulting to actor.clip_ratio."""
    low = actor_cfg.clip_ratio_low if actor_cfg.clip_ratio_low is not None else actor_cfg.clip_ratio
    high = actor_cfg.clip_ratio_high if actor_cfg.clip_ratio_high is not None else actor_cfg.clip_ratio
    return low, high


def actor_loss(logits: Tensor, mb: dict, actor_cfg) -> tuple[Tensor, dict[str, float]]:
    """The policy loss of one micro-batch from its response logits (n_mb, L, V), already divided by the
    rollout temperature: policy-gradient loss (actor.policy_loss.loss_mode) - entropy_coeff * entropy
    (+ kl_loss_coef * KL to the reference policy with actor.use_kl_loss).

    mb: responses, response_mask, old_logprobs, advantages (and ref_logprobs), (n_mb, L) each.
    Returns (loss, metrics): the policy loss's actor/pg_loss, pg_clipfrac, ... plus actor/entropy
    (and actor/kl_loss)."""
    logprobs = gather_logprobs(logits, mb["responses"])  # (n_mb, L)
    low, high = clip_bounds(actor_cfg)
    pg_loss, metrics = get_policy_loss_fn(actor_cfg.policy_loss.loss_mode)(
        mb["old_logprobs"],
        logprobs,
        mb["advantages"],
        mb["response_mask"],
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=actor_cfg.clip_ratio_c,
        loss_agg_mode=actor_cfg.loss_agg_mode,
    )
    entropy = masked_mean(entropy_from_logits(logits), mb["response_mask"])
    loss = pg_loss - actor_cfg.entropy_coeff * entropy
    metrics = {**metrics, "actor/entropy": float(entropy.detach())}
    if actor_cfg.use_kl_loss:
        kl = masked_mean(compute_kl_penalty(logprobs, mb["ref_logprobs"], actor_cfg.kl_loss_type), mb["response_mask"])
        loss = loss + actor_cfg.kl_loss_coef * kl
        metrics["actor/kl_loss"] = float(kl.detach())
    return loss, metrics


def critic_loss(vpreds: Tensor, mb: dict, critic_cfg) -> tuple[Tensor, dict[str, float]]:
    """The clipped value loss of one micro-batch: vpreds (n_mb, L) against mb's returns, clipped around
    its rollout-time old_values (stages.algos.value). Returns (loss, critic/vf_loss, vf_clipfrac, ...)."""
    return compute_value_loss(
        vpreds,
        mb["returns"],
        mb["old_values"],
        mb["response_mask"],
        cliprange_value=critic_cfg.cliprange_value,
        loss_agg_mode=critic_cfg.loss_agg_mode,
    )
