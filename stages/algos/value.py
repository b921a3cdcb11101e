"""Clipped value (critic) loss for PPO with GAE.

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

Choices (verl's `compute_value_loss`): the new prediction is clipped to within cliprange_value of
the rollout-time value, the per-token loss is the larger of the clipped and unclipped squared
errors, and the aggregate is halved (0.5 * MSE).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stages.algos.losses import GlobalBatch, aggregate_loss
from stages.algos.masking import masked_mean


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    old_values: Tensor,
    response_mask: Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    *,
    global_batch: GlobalBatch | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO value loss with value clipping.

    Schulman et al. 2017, https://arxiv.org/abs/1707.06347 (value clipping as in OpenAI baselines
    ppo2 and verl): L = 0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)).

    Args:
        vpreds: (N, L) current critic values (requires grad).
        returns: (N, L) targets (GAE returns).
        old_values: (N, L) critic values at rollout time.
        response_mask: (N, L) float {0,1}.
        cliprange_value: c, the largest move of a prediction away from old_values.
        loss_agg_mode: one of losses.LOSS_AGG_MODES; global_batch, norm_length: as losses.aggregate_loss
            (the loss is the micro-batch's share of its mini-batch's loss, as verl >= 0.8).
    Returns:
        (loss, metrics) with critic/vf_loss, critic/vf_clipfrac (fraction of counted tokens where
        the clipped error is the larger), critic/vpred_mean.
    """
    assert vpreds.shape == returns.shape == old_values.shape == response_mask.shape, (
        f"{vpreds.shape=} {returns.shape=} {old_values.shape=} {response_mask.shape=}"
    )
    # clamp vpreds itself (verl's clip_by_value): a prediction inside the range comes back bit-exact, so
    # clipfrac counts real clipping only (old + (v - old) differs from v by rounding and made clipfrac noise)
    vpred_clipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)  # (N, L)
    loss_unclipped = (vpreds - returns).square()  # (N, L)
    loss_clipped = (vpred_clipped - returns).square()  # (N, L)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    loss = 0.5 * aggregate_loss(
        loss_mat, response_mask, loss_agg_mode, norm_length=norm_length, global_batch=global_batch
    )
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": float(loss.detach()),
            "critic/vf_clipfrac": float(masked_mean((loss_clipped > loss_unclipped).float(), response_mask)),
            "critic/vpred_mean": float(masked_mean(vpreds, response_mask)),
        }
    return loss, metrics
