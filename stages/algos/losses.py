"""PPO policy loss with clip-higher and dual clip, loss aggregation modes, entropy.

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

Choices (verl's core_algos semantics):
- ratio = exp(logprobs - old_logprobs), with the log-ratio clamped to [-20, 20] for stability.
- clip with separate bounds [1 - clip_ratio_low, 1 + clip_ratio_high] (DAPO clip-higher,
  https://arxiv.org/abs/2503.14476); dual clip (Ye et al. 2020, https://arxiv.org/abs/1912.09729)
  bounds the loss of negative-advantage tokens by -A * clip_ratio_c.
- loss_agg_mode: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm.
  Deviation: seq-mean-token-sum-norm divides the token sum by N * norm_length (Dr.GRPO's batch
  mean over a constant length); verl divides by L only, so its scale grows with the micro-batch.
- GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071) clips one length-normalized
  sequence ratio per rollout instead of per-token ratios.
- POLICY_LOSS_FNS maps verl's `policy_loss.loss_mode` names (vanilla, gspo) to functions with one
  shared signature.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from stages.algos.masking import masked_mean

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSS_FNS",
    "aggregate_loss",
    "compute_policy_loss",
    "compute_policy_loss_gspo",
    "entropy_from_logits",
    "gather_logprobs",
    "get_policy_loss_fn",
    "masked_mean",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate_loss(loss_mat: Tensor, response_mask: Tensor, mode: str, *, norm_length: int | None = None) -> Tensor:
    """Reduce a per-token loss to a scalar.

    Args:
        loss_mat: (N, L) per-token loss.
        response_mask: (N, L) float {0,1}.
        mode: one of LOSS_AGG_MODES.
        norm_length: the constant divisor of seq-mean-token-sum-norm (Dr.GRPO); defaults to L.
    Returns:
        scalar.
    """
    assert loss_mat.shape == response_mask.shape, f"{loss_mat.shape=} {response_mask.shape=}"
    if mode == "token-mean":
        return masked_mean(loss_mat, response_mask)
    seq_sum = (loss_mat * response_mask).sum(dim=-1)  # (N,)
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    if mode == "seq-mean-token-mean":
        return (seq_sum / response_mask.sum(dim=-1).clamp(min=1.0)).mean()
    if mode == "seq-mean-token-sum-norm":
        return seq_sum.sum() / (loss_mat.shape[0] * (norm_length or loss_mat.shape[-1]))
    raise ValueError(f"Unknown loss_agg_mode '{mode}'. Valid: {list(LOSS_AGG_MODES)}")


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
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual clip; verl's "vanilla" loss mode.

    Schulman et al. 2017, https://arxiv.org/abs/1707.06347; clip-higher from DAPO; dual clip from
    Ye et al. 2020, https://arxiv.org/abs/1912.09729.

    Args:
        old_logprobs: (N, L) log-probs of the sampled tokens under the behaviour policy.
        logprobs: (N, L) the same under the policy being optimized (requires grad).
        advantages: (N, L) token advantages.
        response_mask: (N, L) float {0,1}.
    Returns:
        (loss, metrics) with actor/pg_loss, actor/pg_clipfrac, actor/pg_clipfrac_lower,
        actor/ppo_kl.
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
    loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode)
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
        clip_ratio_c: unused (no dual clip in GSPO); kept for the shared signature.
        loss_agg_mode: the paper's objective is seq-mean-token-mean (verl forces it; rlake
            honours the argument).
    Returns:
        (loss, metrics) with actor/pg_loss, actor/pg_clipfrac, actor/pg_clipfrac_lower (0),
        actor/ppo_kl.
    """
    del clip_ratio_c
    log_ratio = logprobs - old_logprobs  # (N, L)
    seq_log_ratio = (log_ratio * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1.0)
    log_seq_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]  # (N, L)
    ratio = torch.exp(log_seq_ratio.clamp(max=10.0))  # (N, L), value s_i on every token
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)  # (N, L)
    loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode)
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
    response_mask (N, L), *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode)
    and returns (loss, metrics).
    """
    if name not in POLICY_LOSS_FNS:
        raise ValueError(f"Unknown policy loss '{name}'. Valid: {sorted(POLICY_LOSS_FNS)}")
    return POLICY_LOSS_FNS[name]


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution per position.

    Args:
        logits: (N, L, V).
    Returns:
        (N, L).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, L, V)
    return -(logp.exp() * logp).sum(dim=-1)


def gather_logprobs(logits: Tensor, token_ids: Tensor) -> Tensor:
    """Log-prob of each given token under the logits at the same position.

    Args:
        logits: (N, L, V) logits predicting position t from t-1's context.
        token_ids: (N, L) int64.
    Returns:
        (N, L).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, L, V)
    return logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # (N, L)
