"""DAPO's data-side pieces: dynamic-sampling group filter and overlong reward shaping.

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

Yu et al. 2025, https://arxiv.org/abs/2503.14476. Clip-higher is losses.compute_policy_loss's
clip_ratio_high and token-level loss is loss_agg_mode="token-mean"; this module holds the rest.
"""

from __future__ import annotations

import torch
from torch import Tensor


def filter_groups_by_variance(scores: Tensor, group_ids: Tensor, *, keep_singletons: bool = False) -> Tensor:
    """Dynamic sampling: keep only groups whose scores are not all equal.

    DAPO section 3.2: a group where every rollout got the same reward (all correct or all
    wrong) has zero group-relative advantage and so no gradient; drop it and sample more.

    Args:
        scores: (N,) outcome score (or any metric: verl's filter_groups.metric) per rollout.
        group_ids: (N,) int64; rollouts of one prompt share an id.
        keep_singletons: keep groups of one rollout (verl keeps them; they have no spread).
    Returns:
        (N,) bool keep mask.
    """
    assert scores.shape == group_ids.shape, f"{scores.shape=} {group_ids.shape=}"
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (N,) dense 0..K-1
    k = int(inverse.max()) + 1 if inverse.numel() else 0
    v = scores.to(torch.float64)
    hi = torch.full((k,), -torch.inf, dtype=torch.float64, device=v.device)
    hi = hi.scatter_reduce(0, inverse, v, reduce="amax")  # (K,)
    lo = torch.full((k,), torch.inf, dtype=torch.float64, device=v.device)
    lo = lo.scatter_reduce(0, inverse, v, reduce="amin")  # (K,)
    keep = hi > lo  # (K,)
    if keep_singletons:
        keep |= torch.bincount(inverse, minlength=k) == 1
    return keep[inverse]  # (N,)


def overlong_reward_penalty(
    response_lengths: Tensor, max_response_length: int, overlong_buffer_len: int, penalty_factor: float = 1.0
) -> Tensor:
    """Soft overlong punishment, added to the task reward (DAPO eq. 13, verl's overlong_buffer).

    With L_max = max_response_length and L_cache = overlong_buffer_len:
    0 for |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache in between; -1 beyond L_max;
    all times penalty_factor.

    Args:
        response_lengths: (N,) generated tokens per rollout.
        max_response_length: L_max.
        overlong_buffer_len: L_cache, 0 < L_cache <= L_max.
        penalty_factor: scale of the penalty (verl: overlong_buffer.penalty_factor).
    Returns:
        (N,) float penalty in [-penalty_factor, 0].
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len ({overlong_buffer_len}) must be in "
            f"(0, max_response_length={max_response_length}], because the penalty "
            "ramps over the last overlong_buffer_len tokens; lower it."
        )
    expected = max_response_length - overlong_buffer_len
    exceed = (response_lengths.to(torch.float32) - expected) / overlong_buffer_len  # (N,)
    return -exceed.clamp(min=0.0, max=1.0) * penalty_factor
