"""Masked reductions shared by the estimators and losses.

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

Whitening follows verl's `masked_whiten`: mean and unbiased (Bessel-corrected) variance over the
masked entries, `(x - mean) * rsqrt(var + 1e-8)`. A mask with fewer than two entries gets no
Bessel correction (verl raises instead).
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of values where mask is 1; 0 when the mask is empty.

    Args:
        values: any shape S.
        mask: shape S, float {0,1}.
        dim: reduce only this dimension (e.g. -1 for a per-sequence mean of an (N, L) tensor).
    Returns:
        scalar, or S without `dim`.
    """
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1.0)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of values where mask is 1 (scalar).

    Args:
        values: any shape S.
        mask: shape S, float {0,1}.
        unbiased: apply Bessel's correction n / (n - 1) when n >= 2.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean).square(), mask)
    if unbiased:
        n = mask.sum()
        var = var * torch.where(n > 1, n / (n - 1).clamp(min=1.0), torch.ones_like(n))
    return var


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Standardize values with the masked mean and unbiased variance (verl semantics).

    Args:
        values: any shape S, finite everywhere.
        mask: shape S, float {0,1}.
        shift_mean: False adds the mean back (scale only).
    Returns:
        shape S; entries where the mask is 0 are transformed too (callers zero them).
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    return whitened if shift_mean else whitened + mean
