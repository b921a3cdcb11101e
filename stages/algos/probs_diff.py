"""The gap between the rollout engine's sampling probabilities and the trainer's (verl
`verl/utils/debug/metrics.py` `calculate_debug_metrics`).

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

The engine samples with its own numerics (vLLM kernels, bf16, the HF engine's pad suppression); the
actor recomputes the log-probs of the same tokens before the update (`old_logprobs`, verl's
`compute_log_prob`). On counted response tokens the gap is d = |exp(old_logprobs) - exp(rollout_logprobs)|,
a difference of probabilities, not of log-probs (verl's names say "probs"). verl's five numbers: valid
(1, or 0 when no token is counted: the others are then NaN), max, mean and unbiased std (torch.std) of d,
and the Pearson correlation of the two probability vectors (https://arxiv.org/abs/2506.13585). A single
counted token has a NaN std and correlation, as in verl. Computed in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

PROBS_DIFF_KEYS = (
    "training/rollout_probs_diff_valid",
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_std",
    "training/rollout_actor_probs_pearson_corr",
)
"""verl's metric names, in its order."""


def rollout_probs_diff(
    old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor
) -> tuple[dict[str, float], Tensor, Tensor]:
    """verl's rollout-vs-actor probability gap over the batch, and per rollout.

    Args:
        old_logprobs: (N, L) the actor's recomputed log-probs of the sampled tokens.
        rollout_logprobs: (N, L) the rollout engine's sampling log-probs of the same tokens.
        response_mask: (N, L) float {0,1}, 1 = a response token.
    Returns:
        (metrics with PROBS_DIFF_KEYS, per_row_max (N,), per_row_mean (N,)): the max and mean of
        |exp(old) - exp(rollout)| over each row's counted tokens, NaN for a row with none (float64).
    """
    assert old_logprobs.shape == rollout_logprobs.shape == response_mask.shape, (
        f"{old_logprobs.shape=} {rollout_logprobs.shape=} {response_mask.shape=}"
    )
    mask = response_mask.bool()  # (N, L)
    old_p, rollout_p = old_logprobs.double().exp(), rollout_logprobs.double().exp()  # (N, L)
    diff = (old_p - rollout_p).abs()  # (N, L)
    counted = mask.sum(-1)  # (N,)
    nan = torch.full_like(counted, float("nan"), dtype=torch.float64)  # (N,)
    if diff.shape[-1] == 0:
        row_max = row_mean = nan
    else:
        row_max = torch.where(counted > 0, diff.masked_fill(~mask, float("-inf")).amax(-1), nan)  # (N,)
        row_mean = torch.where(counted > 0, (diff * mask).sum(-1) / counted.clamp(min=1), nan)  # (N,)
    if not mask.any():
        return dict(zip(PROBS_DIFF_KEYS, (0.0, *[float("nan")] * 4), strict=True)), row_max, row_mean
    tokens = diff[mask]  # (K,) the K counted tokens
    std = pearson = float("nan")  # K = 1: no spread (torch would warn, then give NaN too)
    if tokens.numel() > 1:
        std = tokens.std().item()  # unbiased
        pearson = torch.corrcoef(torch.stack([old_p[mask], rollout_p[mask]]))[0, 1].item()  # (2, K) -> NaN if constant
    values = (1.0, tokens.max().item(), tokens.mean().item(), std, pearson)
    return dict(zip(PROBS_DIFF_KEYS, values, strict=True)), row_max, row_mean
