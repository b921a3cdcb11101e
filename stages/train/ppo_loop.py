"""The one PPO optimization loop, shared by the torch actor (stages.train.actor), the critic
(stages.train.critic) and the Megatron actor (stages.train.megatron.ppo), and their per-micro-batch losses.

Schedule (verl's): an update makes `epochs` passes over this worker's N rollouts. Each pass draws one
permutation from a generator seeded with the update's seed and cuts it into mini-batches (one optimizer
step each) of micro-batches (one forward/backward each). Every loss term (policy loss, entropy bonus, KL
loss, value loss) of a micro-batch is its share of the whole mini-batch's loss under loss_agg_mode
(verl >= 0.8: normalised by the mini-batch's counted tokens or non-empty rows over all data-parallel
ranks, `GlobalBatch`), so the accumulated gradient is the mini-batch's gradient however the mini-batch is
cut into micro-batches or ranks; then the gradients are finished (clipped; Megatron also reduces them over
its groups) and one optimizer step is taken.
Metrics: the loss terms (SUMMED_METRICS) are summed over a mini-batch's micro-batches (= the mini-batch's
loss), other per-micro-batch metrics (clip fractions, ppo_kl) averaged over them; then both are averaged
over optimizer steps (as grad_norm and lr) and over the data-parallel workers.

Shape legend: n_mb rollouts of a micro-batch, L response len, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from configs.schema import ActorConfig, CriticConfig, RolloutCorrectionConfig
from stages.algos.kl import compute_kl_penalty
from stages.algos.losses import GlobalBatch, aggregate_loss, entropy_from_logits, gather_logprobs, get_policy_loss_fn
from stages.algos.rollout_is import batch_normalize_weights, compute_rollout_correction, rollout_is_norm_terms
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


def collective_device(group=None) -> torch.device:
    """Where a collective's tensors must live: the current CUDA device under NCCL (it reduces CUDA tensors
    only), the CPU under gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mean_over_workers(metrics: dict[str, float], world: int, group=None) -> dict[str, float]:
    """Each metric averaged over the `world` ranks of a torch.distributed group (default: the whole group)."""
    if world <= 1:
        return metrics
    keys = sorted(metrics)
    t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, group=group)
    return {k: float(v) / world for k, v in zip(keys, t, strict=True)}


def minibatches(
    n: int, per_worker_mini: int, epochs: int, generator: torch.Generator, steps: int | None = None
) -> Iterator[Tensor]:
    """Row indices of each mini-batch: per epoch one permutation of range(n) from `generator`, cut in order
    into `steps` parts (default ceil(n / per_worker_mini)) whose sizes differ by at most one. A multiple of
    per_worker_mini is cut into mini-batches of exactly per_worker_mini rows; a batch that lost rows (the
    reward stage's flagged rollouts dropped) keeps its number of optimizer steps, each a little smaller."""
    steps = steps or -(-n // per_worker_mini)
    assert n >= steps, f"{n=} rows cannot fill {steps=} mini-batches"
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        yield from order.tensor_split(steps)


def shard_for_rank(n: int, mini: int, rank: int, world: int) -> list[int]:
    """Indices of this rank's rows: the rank-th contiguous slice of every mini-batch of `mini` rows (mini / world
    rows each). A last mini-batch short of `mini` rows (the reward stage's flagged rollouts were dropped,
    reward.on_error='flag') is split as evenly as its rows allow."""
    sizes = [(m, min(mini, n - m)) for m in range(0, n, mini)]
    return [i for m, size in sizes for i in range(m + rank * size // world, m + (rank + 1) * size // world)]


def global_minibatch_count(n: int, per_worker_mini: int, world: int = 1, group=None) -> tuple[int, int]:
    """(rollouts over all `world` data-parallel ranks, optimizer steps per epoch = ceil(that / (world *
    per_worker_mini))): every rank takes the same number of steps, also when the ranks hold unequal shares of
    a batch that is not a multiple of the mini-batch size (shard_for_rank)."""
    total = n
    if world > 1:
        t = torch.tensor([n], dtype=torch.int64, device=collective_device(group))
        dist.all_reduce(t, group=group)
        total = int(t.item())
    return total, -(-total // (per_worker_mini * world))


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
    steps: int | None = None,
    split: Callable[[Tensor], list[Tensor]] | None = None,
) -> None:
    """The optimizer steps of one update over n rollouts (see the module docstring); `steps` per epoch (default
    ceil(n / mini_batch_size); data-parallel ranks pass global_minibatch_count's, so they all take as many).

    backward(micro-batches) runs forward/backward of one mini-batch, given as the row indices of each of
    its micro-batches (micro_batch_size rows, the last one may be smaller; `split(mini)` gives them instead when
    set: actor.use_dynamic_bsz's token budget, stages.train.packing.split_by_tokens); finish_grads() makes the
    gradients final and returns the global grad norm; then one
    optimizer_step (error: the message of a non-finite norm, prefix: of the grad_norm and lr metrics)."""
    gen = torch.Generator().manual_seed(seed)
    for mini in minibatches(n, mini_batch_size, epochs, gen, steps):
        backward(split(mini) if split is not None else list(mini.split(micro_batch_size)))
        grad_norm = finish_grads()
        optimizer_step(optimizer, scheduler, grad_norm, metrics.add, prefix=prefix, error=error)


SUMMED_METRICS = frozenset({"actor/pg_loss", "actor/entropy", "actor/kl_loss", "critic/vf_loss"})
"""Loss terms: a micro-batch reports its share of the mini-batch's value, so the mini-batch's is their sum."""


def fold_minibatch(metrics: MetricAccumulator, micro: list[dict[str, float]]) -> None:
    """Add one mini-batch's metrics from those of its micro-batches: SUMMED_METRICS summed, others averaged."""
    for key in sorted({k for m in micro for k in m}):
        values = [m[key] for m in micro if key in m]
        metrics.add(key, sum(values) if key in SUMMED_METRICS else sum(values) / len(values))


def mini_batch_counts(response_mask: Tensor, dp_size: int = 1, group=None) -> GlobalBatch:
    """The GlobalBatch of a mini-batch from this rank's rows of it, response_mask (n_mini, L): counted
    tokens and rows (fully masked ones too, as verl's global_batch_size) summed over the dp_size data-parallel
    ranks of `group` (a collective)."""
    counts = torch.tensor([float(response_mask.sum()), float(response_mask.shape[0])], dtype=torch.float64)
    if dp_size > 1:
        counts = counts.to(collective_device(group))
        dist.all_reduce(counts, group=group)
    return GlobalBatch(float(counts[0]), float(counts[1]), dp_size)


def accumulate_grads(
    batch: dict,
    micro_idx: list[Tensor],
    loss_fn: Callable[[dict, GlobalBatch], tuple[Tensor, dict]],
    metrics: MetricAccumulator,
    *,
    dp_size: int = 1,
    no_sync: Callable | None = None,
) -> None:
    """The torch `backward` of ppo_loop: loss_fn(micro-batch, the mini-batch's GlobalBatch) -> (loss,
    metrics) on each micro-batch of `batch`, loss.backward() (the loss is already the micro-batch's share
    of the mini-batch loss). dp_size: ranks of the default process group sharing the mini-batch (DDP);
    no_sync: DDP's context manager, so that the gradients are all-reduced once, at the last micro-batch."""
    global_batch = mini_batch_counts(batch["response_mask"][torch.cat(micro_idx)], dp_size)
    n_micro, micro_metrics = len(micro_idx), []
    for k, idx in enumerate(micro_idx):
        mb = select_rows(batch, idx)
        ctx = no_sync() if no_sync is not None and k < n_micro - 1 else torch.enable_grad()
        with ctx:
            loss, m = loss_fn(mb, global_batch)
            loss.backward()
        micro_metrics.append(m)
    fold_minibatch(metrics, micro_metrics)


def apply_rollout_correction(
    batch: dict, cfg: RolloutCorrectionConfig | None, *, dp_size: int = 1, group=None
) -> dict[str, float]:
    """verl's decoupled rollout correction (algorithm.rollout_correction; stages.algos.rollout_is) of this rank's
    padded batch, in place, once before the optimizer steps: from its old_logprobs and the engine's
    rollout_logprobs (N, L), batch["rollout_is_weights"] (N, L) for rollout_is, and for rollout_rs the
    response_mask without the rejected tokens (so every loss term and the mini-batch counts leave them out, as
    verl's). rollout_is_batch_normalize divides by the mean over all dp_size ranks of `group` (a collective).
    Returns the rollout_corr/ metrics of this rank's rows ({} and no change when cfg is None or off)."""
    if cfg is None or not cfg.enabled:
        return {}
    mask = batch["response_mask"]
    weights, new_mask, metrics = compute_rollout_correction(
        batch["old_logprobs"],
        batch["rollout_logprobs"],
        mask,
        rollout_is=cfg.rollout_is,
        is_bounds=cfg.is_bounds(),
        rs_bounds=cfg.rs_bounds(),
    )
    if weights is not None and cfg.rollout_is_batch_normalize:
        terms = rollout_is_norm_terms(weights, mask, cfg.rollout_is)  # (2,) this rank's [sum, count]
        if dp_size > 1:
            terms = terms.to(collective_device(group))
            dist.all_reduce(terms, group=group)
        weights, norm_metrics = batch_normalize_weights(weights, terms.cpu())
        metrics |= norm_metrics
    if weights is not None:
        batch["rollout_is_weights"] = weights
    batch["response_mask"] = new_mask
    return metrics


def clip_bounds(actor_cfg: ActorConfig) -> tuple[float, float]:
    """(clip_ratio_low, clip_ratio_high), each defaulting to actor.clip_ratio."""
    low = actor_cfg.clip_ratio_low if actor_cfg.clip_ratio_low is not None else actor_cfg.clip_ratio
    high = actor_cfg.clip_ratio_high if actor_cfg.clip_ratio_high is not None else actor_cfg.clip_ratio
    return low, high


def actor_loss(
    logits: Tensor, mb: dict, actor_cfg: ActorConfig, global_batch: GlobalBatch | None = None
) -> tuple[Tensor, dict[str, float]]:
    """The policy loss of one micro-batch from its response logits (n_mb, L, V), already divided by the
    rollout temperature: actor_loss_terms of their log-probs of mb["responses"] and their entropy."""
    return actor_loss_terms(
        gather_logprobs(logits, mb["responses"]), entropy_from_logits(logits), mb, actor_cfg, global_batch
    )


def actor_loss_terms(
    logprobs: Tensor, entropy: Tensor, mb: dict, actor_cfg: ActorConfig, global_batch: GlobalBatch | None = None
) -> tuple[Tensor, dict[str, float]]:
    """The policy loss of one micro-batch from the log-probs of its response tokens and the entropy at each,
    (n_mb, L) each (any value where response_mask is 0; a packed forward gives 0 there, stages.train.packing):
    policy-gradient loss (actor.policy_loss.loss_mode) - entropy_coeff * entropy (+ kl_loss_coef * KL to the
    reference policy with actor.use_kl_loss), every term aggregated with actor.loss_agg_mode over `global_batch`
    (verl >= 0.8; None: the micro-batch is the mini-batch).

    mb: response_mask, old_logprobs, advantages (and ref_logprobs, rollout_is_weights), (n_mb, L) each.
    Returns (loss, metrics): the policy loss's actor/pg_loss, pg_clipfrac, ... plus actor/entropy
    (and actor/kl_loss); the loss terms are this micro-batch's shares of the mini-batch's values."""
    low, high = clip_bounds(actor_cfg)
    mask, mode = mb["response_mask"], actor_cfg.loss_agg_mode
    agg = {"global_batch": global_batch, "norm_length": actor_cfg.loss_scale_factor}
    pg_loss, metrics = get_policy_loss_fn(actor_cfg.policy_loss.loss_mode)(
        mb["old_logprobs"],
        logprobs,
        mb["advantages"],
        mask,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=actor_cfg.clip_ratio_c,
        loss_agg_mode=mode,
        rollout_is_weights=mb.get("rollout_is_weights"),
        **agg,
    )
    entropy = aggregate_loss(entropy, mask, mode, **agg)
    loss = pg_loss - actor_cfg.entropy_coeff * entropy
    metrics = {**metrics, "actor/entropy": float(entropy.detach())}
    if actor_cfg.use_kl_loss:
        kl = aggregate_loss(compute_kl_penalty(logprobs, mb["ref_logprobs"], actor_cfg.kl_loss_type), mask, mode, **agg)
        loss = loss + actor_cfg.kl_loss_coef * kl
        metrics["actor/kl_loss"] = float(kl.detach())
    return loss, metrics


def critic_loss(
    vpreds: Tensor, mb: dict, critic_cfg: CriticConfig, global_batch: GlobalBatch | None = None
) -> tuple[Tensor, dict[str, float]]:
    """The clipped value loss of one micro-batch: vpreds (n_mb, L) against mb's returns, clipped around
    its rollout-time old_values (stages.algos.value), aggregated with critic.loss_agg_mode over
    `global_batch` as actor_loss. Returns (loss, critic/vf_loss, vf_clipfrac, ...)."""
    return compute_value_loss(
        vpreds,
        mb["returns"],
        mb["old_values"],
        mb["response_mask"],
        cliprange_value=critic_cfg.cliprange_value,
        loss_agg_mode=critic_cfg.loss_agg_mode,
        global_batch=global_batch,
        norm_length=critic_cfg.loss_scale_factor,
    )
