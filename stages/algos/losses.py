"""PPO policy loss with clip-higher and dual clip, loss aggregation modes, entropy.

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

Choices (verl's core_algos semantics):
- ratio = exp(logprobs - old_logprobs), with the log-ratio clamped to [-20, 20] for stability.
- clip with separate bounds [1 - clip_ratio_low, 1 + clip_ratio_high] (DAPO clip-higher,
  https://arxiv.org/abs/2503.14476); dual clip (Ye et al. 2020, https://arxiv.org/abs/1912.09729)
  bounds the loss of negative-advantage tokens by -A * clip_ratio_c.
- loss_agg_mode: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm,
  normalised as verl >= 0.8 `agg_loss` does: a micro-batch's loss is its share of the loss of the
  whole mini-batch (all micro-batches, all data-parallel ranks; `GlobalBatch`), so the accumulated
  gradient does not depend on how a mini-batch is split. token-mean divides the micro-batch's token
  sum by the mini-batch's counted tokens; the seq-mean modes divide by ALL the mini-batch's rows,
  fully masked ones included (a response of 0 tokens, a rollout rejected by rollout_rs): verl's trainer
  passes agg_loss global_batch_size = ppo_mini_batch_size x rollout.n (ray_trainer._update_actor /
  _update_critic), and a fully masked row adds 0 to the sum but counts in that size. (verl's agg_loss
  called alone, without global_batch_size, counts the non-empty rows; rlake's default is the trainer's.)
  seq-mean-token-sum-norm (Dr.GRPO) further divides by a constant length (norm_length, default L), so
  it equals token sum / (rows x L), as verl's. Each is multiplied by dp_size because data-parallel
  gradient reduction averages over ranks.
- GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071) clips one length-normalized
  sequence ratio per rollout instead of per-token ratios, and is always aggregated
  seq-mean-token-mean (as verl, whatever loss_agg_mode says).
- POLICY_LOSS_FNS maps verl's `policy_loss.loss_mode` names (vanilla, gspo) to functions with one
  shared signature.
- Rollout correction (verl's algorithm.rollout_correction): optional detached weights (stages.algos.rollout_is)
  multiply the per-token loss of either mode before aggregation; clip fractions and ppo_kl ignore them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from stages.algos.masking import masked_mean

__all__ = [
    "LOSS_AGG_MODES",
    "GlobalBatch",
    "POLICY_LOSS_FNS",
    "aggregate_loss",
    "at_least_float32",
    "compute_policy_loss",
    "compute_policy_loss_gspo",
    "entropy_from_logits",
    "gather_logprobs",
    "get_policy_loss_fn",
    "masked_mean",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class GlobalBatch:
    """What a micro-batch's loss is normalised by: the mini-batch it belongs to (verl's global_batch_info).

    num_tokens: counted (mask 1) tokens of the whole mini-batch, summed over the data-parallel ranks.
    num_seqs: rows of the whole mini-batch, fully masked ones included, over the ranks (verl's
        global_batch_size = ppo_mini_batch_size x rollout.n for a whole batch).
    dp_size: data-parallel ranks whose gradients are averaged.
    """

    num_tokens: float
    num_seqs: float
    dp_size: int = 1

    @staticmethod
    def of(response_mask: Tensor) -> GlobalBatch:
        """The batch of one rank holding every row of the mini-batch: response_mask (N, L) float {0,1}."""
        return GlobalBatch(float(response_mask.sum()), float(response_mask.shape[0]), 1)


def aggregate_loss(
    loss_mat: Tensor,
    response_mask: Tensor,
    mode: str,
    *,
    norm_length: int | None = None,
    global_batch: GlobalBatch | None = None,
) -> Tensor:
    """Reduce a micro-batch's per-token loss to its share of the mini-batch loss (verl >= 0.8 `agg_loss`).

    Args:
        loss_mat: (n_mb, L) per-token loss of the micro-batch.
        response_mask: (n_mb, L) float {0,1}.
        mode: one of LOSS_AGG_MODES.
        norm_length: the constant divisor of seq-mean-token-sum-norm (Dr.GRPO); defaults to L.
        global_batch: the mini-batch's counts; None = this micro-batch is the whole mini-batch, one rank.
    Returns:
        scalar; summed over the micro-batches of a mini-batch (and averaged over its ranks) it is the
        mini-batch's loss under `mode`.
    """
    assert loss_mat.shape == response_mask.shape, f"{loss_mat.shape=} {response_mask.shape=}"
    gb = global_batch if global_batch is not None else GlobalBatch.of(response_mask)
    if mode == "token-mean":
        return (loss_mat * response_mask).sum() / max(gb.num_tokens, 1.0) * gb.dp_size
    seq_sum = (loss_mat * response_mask).sum(dim=-1)  # (n_mb,); fully masked rows add 0, count in num_seqs
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = seq_sum.sum() / max(gb.num_seqs, 1.0) * gb.dp_size
        return loss / (norm_length or loss_mat.shape[-1]) if mode == "seq-mean-token-sum-norm" else loss
    if mode == "seq-mean-token-mean":
        seq_mean = seq_sum / response_mask.sum(dim=-1).clamp(min=1.0)  # (n_mb,)
        return seq_mean.sum() / max(gb.num_seqs, 1.0) * gb.dp_size
    raise ValueError(f"Unknown loss_agg_mode '{mode}'. Valid: {list(LOSS_AGG_MODES)}")


# long: verl's vanilla loss as one formula (clip, dual clip, rollout-correction weights) with its metrics
def compute_policy_loss(
    old_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatch | None = None,
    norm_length: int | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual clip; verl's "vanilla" loss mode.

    Schulman et al. 2017, https://arxiv.org/abs/1707.06347; clip-higher from DAPO; dual clip from
    Ye et al. 2020, https://arxiv.org/abs/1912.09729.

    Args:
        old_logprobs: (N, L) log-probs of the sampled tokens under the behaviour policy.
        logprobs: (N, L) the same under the policy being optimized (requires grad).
        advantages: (N, L) token advantages.
        response_mask: (N, L) float {0,1}.
        loss_agg_mode, global_batch, norm_length: as aggregate_loss (N rows of the micro-batch).
        rollout_is_weights: (N, L) detached rollout-correction weights (stages.algos.rollout_is) multiplying
            the per-token loss before aggregation (verl); None = no correction (the loss is unchanged).
    Returns:
        (loss, metrics) with actor/pg_loss (this micro-batch's share of the mini-batch loss),
        actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl (means over the micro-batch's tokens).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1 (dual clip bounds -A * clip_ratio_c), got {clip_ratio_c}; verl's default is 3.0."
        )
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # (N, L)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)  # (N, L)
    loss_dual = torch.minimum(loss_ppo, -advantages * clip_ratio_c)
    loss_mat = torch.where(advantages < 0, loss_dual, loss_ppo)  # (N, L)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights  # (N, L)
    loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode, norm_length=norm_length, global_batch=global_batch)
    with torch.no_grad():
        clipped = (loss_clipped > loss_unclipped).float()
        lower = ((loss_ppo > -advantages * clip_ratio_c) & (advantages < 0)).float()
        metrics = {
            "actor/pg_loss": float(loss.detach()),
            "actor/pg_clipfrac": float(masked_mean(clipped, response_mask)),
            "actor/pg_clipfrac_lower": float(masked_mean(lower, response_mask)),
            "actor/ppo_kl": float(masked_mean(-log_ratio, response_mask)),
        }
    return loss, metrics


# long: the GSPO paper's loss as one formula (sequence ratio, clip, rollout-correction weights) with its metrics
def compute_policy_loss_gspo(
    old_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_batch: GlobalBatch | None = None,
    norm_length: int | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO: PPO clipping on a length-normalized sequence ratio (verl's "gspo" loss mode).

    Zheng et al. 2025, https://arxiv.org/abs/2507.18071. s_i = exp(mean_t log(pi / pi_old)) over
    the counted tokens of rollout i; each token uses sg[s_i] * pi_t / sg[pi_t] (GSPO-token), whose
    value is s_i and whose gradient is s_i * grad log pi_t. The log-ratio is clamped at 10 (verl).

    Args:
        old_logprobs: (N, L) behaviour-policy log-probs of the sampled tokens.
        logprobs: (N, L) current-policy log-probs (requires grad).
        advantages: (N, L) token advantages (constant per rollout for outcome estimators).
        response_mask: (N, L) float {0,1}.
        clip_ratio_low, clip_ratio_high: sequence-ratio clip bounds (paper: 3e-4, 4e-4).
        clip_ratio_c, loss_agg_mode, norm_length: unused, kept for the shared signature: there is no
            dual clip in GSPO, and the paper's objective is seq-mean-token-mean, which verl uses whatever
            actor.loss_agg_mode says (so does rlake).
        global_batch: as aggregate_loss.
        rollout_is_weights: (N, L) or None, as compute_policy_loss.
    Returns:
        (loss, metrics) with actor/pg_loss, actor/pg_clipfrac, actor/pg_clipfrac_lower (0),
        actor/ppo_kl.
    """
    del clip_ratio_c, loss_agg_mode, norm_length
    log_ratio = logprobs - old_logprobs  # (N, L)
    seq_log_ratio = (log_ratio * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1.0)
    log_seq_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]  # (N, L)
    ratio = torch.exp(log_seq_ratio.clamp(max=10.0))  # (N, L), value s_i on every token
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)  # (N, L)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights  # (N, L)
    loss = aggregate_loss(loss_mat, response_mask, "seq-mean-token-mean", global_batch=global_batch)
    with torch.no_grad():
        metrics = {
            "actor/pg_loss": float(loss.detach()),
            "actor/pg_clipfrac": float(masked_mean((loss_clipped > loss_unclipped).float(), response_mask)),
            "actor/pg_clipfrac_lower": 0.0,
            "actor/ppo_kl": float(masked_mean(-log_ratio, response_mask)),
        }
    return loss, metrics


PolicyLossFn = Callable[..., "tuple[Tensor, dict[str, float]]"]
POLICY_LOSS_FNS: dict[str, PolicyLossFn] = {
    "vanilla": compute_policy_loss,
    "gspo": compute_policy_loss_gspo,
}


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under verl's `loss_mode` name.

    Every entry takes (old_logprobs (N, L), logprobs (N, L), advantages (N, L),
    response_mask (N, L), *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
    global_batch, norm_length, rollout_is_weights) and returns (loss, metrics).
    """
    if name not in POLICY_LOSS_FNS:
        raise ValueError(f"Unknown policy loss '{name}'. Valid: {sorted(POLICY_LOSS_FNS)}")
    return POLICY_LOSS_FNS[name]


def at_least_float32(x: Tensor) -> Tensor:
    """x upcast to float32 from a narrower dtype (bf16 logits); float32 and float64 as they are (the same tensor),
    so a float64 model (the packing equality test) keeps its precision."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution per position.

    Args:
        logits: (N, L, V).
    Returns:
        (N, L).
    """
    logp = torch.log_softmax(at_least_float32(logits), dim=-1)  # (N, L, V)
    return -(logp.exp() * logp).sum(dim=-1)


def gather_logprobs(logits: Tensor, token_ids: Tensor) -> Tensor:
    """Log-prob of each given token under the logits at the same position.

    Args:
        logits: (N, L, V) logits predicting position t from t-1's context.
        token_ids: (N, L) int64.
    Returns:
        (N, L).
    """
    logp = torch.log_softmax(at_least_float32(logits), dim=-1)  # (N, L, V)
    return logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # (N, L)
