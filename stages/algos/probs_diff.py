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


MOMENT_KEYS = ("n", "max", "mean_d", "m2_d", "mean_old", "mean_rollout", "m2_old", "m2_rollout", "co_moment")
"""probs_diff_moments' keys: the counted tokens' count, max of d, and the means, centered second moments and
co-moment (Chan et al.'s pairwise form) of d and of the two probability vectors."""


def probs_diff_moments(old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor) -> dict[str, float]:
    """Mergeable statistics of rollout_probs_diff's counted tokens, so ranks that each hold a slice of the batch
    give verl's five metrics of the whole batch (merge_probs_diff_moments, then probs_diff_from_moments).

    Args:
        old_logprobs: (N, L) the actor's recomputed log-probs of the sampled tokens.
        rollout_logprobs: (N, L) the rollout engine's sampling log-probs of the same tokens.
        response_mask: (N, L) float {0,1}, 1 = a counted response token.
    Returns:
        MOMENT_KEYS -> float (float64 sums; n = 0: every other value 0, max -inf).
    """
    mask = response_mask.bool()  # (N, L)
    old_p, rollout_p = old_logprobs.double().exp()[mask], rollout_logprobs.double().exp()[mask]  # (K,) each
    d = (old_p - rollout_p).abs()  # (K,)
    if not d.numel():
        return dict.fromkeys(MOMENT_KEYS, 0.0) | {"max": float("-inf")}
    mo, mr, md = old_p.mean(), rollout_p.mean(), d.mean()
    return {
        "n": float(d.numel()),
        "max": d.max().item(),
        "mean_d": md.item(),
        "m2_d": ((d - md) ** 2).sum().item(),
        "mean_old": mo.item(),
        "mean_rollout": mr.item(),
        "m2_old": ((old_p - mo) ** 2).sum().item(),
        "m2_rollout": ((rollout_p - mr) ** 2).sum().item(),
        "co_moment": ((old_p - mo) * (rollout_p - mr)).sum().item(),
    }


def merge_probs_diff_moments(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """The moments of two disjoint token sets together (Chan, Golub and LeVeque's pairwise update):
    with n = na + nb and delta_x = mean_x(b) - mean_x(a), mean = mean(a) + delta * nb / n, and
    M2 = M2(a) + M2(b) + delta_x^2 * na * nb / n, co-moment C = C(a) + C(b) + delta_x * delta_y * na * nb / n."""
    na, nb = a["n"], b["n"]
    if not nb:
        return dict(a)
    if not na:
        return dict(b)
    n, w = na + nb, na * nb / (na + nb)
    delta = {k: b[k] - a[k] for k in ("mean_d", "mean_old", "mean_rollout")}
    return {
        "n": n,
        "max": max(a["max"], b["max"]),
        "mean_d": a["mean_d"] + delta["mean_d"] * nb / n,
        "m2_d": a["m2_d"] + b["m2_d"] + delta["mean_d"] ** 2 * w,
        "mean_old": a["mean_old"] + delta["mean_old"] * nb / n,
        "mean_rollout": a["mean_rollout"] + delta["mean_rollout"] * nb / n,
        "m2_old": a["m2_old"] + b["m2_old"] + delta["mean_old"] ** 2 * w,
        "m2_rollout": a["m2_rollout"] + b["m2_rollout"] + delta["mean_rollout"] ** 2 * w,
        "co_moment": a["co_moment"] + b["co_moment"] + delta["mean_old"] * delta["mean_rollout"] * w,
    }


def probs_diff_from_moments(m: dict[str, float]) -> dict[str, float]:
    """rollout_probs_diff's five metrics (PROBS_DIFF_KEYS) from probs_diff_moments (merged): max, mean,
    unbiased std = sqrt(M2_d / (n - 1)), Pearson r = C / sqrt(M2_old * M2_rollout); as there, n = 0 gives
    valid 0 and NaNs, n = 1 a NaN std and correlation, a constant vector a NaN correlation."""
    n = m["n"]
    if not n:
        return dict(zip(PROBS_DIFF_KEYS, (0.0, *[float("nan")] * 4), strict=True))
    std = pearson = float("nan")
    if n > 1:
        std = (max(m["m2_d"], 0.0) / (n - 1)) ** 0.5
        spread = m["m2_old"] * m["m2_rollout"]
        pearson = m["co_moment"] / spread**0.5 if spread > 0 else float("nan")
    return dict(zip(PROBS_DIFF_KEYS, (1.0, m["max"], m["mean_d"], std, pearson), strict=True))
