"""GAE: hand-derived numbers, loop vs a vectorized reference, invariance to masked positions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.algos.gae import compute_gae_advantages

T = torch.tensor


def test_gae_golden_gamma_lam_one():
    # rewards [0, 1], values [0.5, 0.8], gamma = lam = 1:
    # delta_1 = 1 + 0 - 0.8 = 0.2 -> A_1 = 0.2; delta_0 = 0 + 0.8 - 0.5 = 0.3 -> A_0 = 0.5;
    # returns = A + V = [1.0, 1.0] (Monte-Carlo return).
    adv, ret = compute_gae_advantages(T([[0.0, 1.0]]), T([[0.5, 0.8]]), torch.ones(1, 2), whiten=False)
    torch.testing.assert_close(adv, T([[0.5, 0.2]]))
    torch.testing.assert_close(ret, T([[1.0, 1.0]]))


def test_gae_golden_discounted_and_whitened():
    # gamma 0.9, lam 0.5: delta_1 = 0.2 -> A_1 = 0.2; delta_0 = 0.9*0.8 - 0.5 = 0.22,
    # A_0 = 0.22 + 0.45*0.2 = 0.31; returns [0.81, 1.0].
    # whitening two values: mean 0.255, deviations ±0.055, unbiased var 2*0.055^2/1 = 0.00605,
    # std 0.077782 -> ±0.707107 (any two distinct values whiten to ±1/sqrt(2)).
    r, v, m = T([[0.0, 1.0]]), T([[0.5, 0.8]]), torch.ones(1, 2)
    adv, ret = compute_gae_advantages(r, v, m, 0.9, 0.5, whiten=False)
    torch.testing.assert_close(adv, T([[0.31, 0.2]]))
    torch.testing.assert_close(ret, T([[0.81, 1.0]]))
    adv_w, _ = compute_gae_advantages(r, v, m, 0.9, 0.5)
    torch.testing.assert_close(adv_w, T([[0.707107, -0.707107]]), atol=1e-5, rtol=0)


def gae_vectorized(rewards, values, mask, gamma, lam):
    """Reference: compact the counted tokens to the front of each row, then
    A = delta @ D with D[k, t] = (gamma*lam)^(k-t) for k >= t, and scatter back."""
    n, length = rewards.shape
    order = torch.argsort((mask == 0).to(torch.int64), dim=-1, stable=True)  # counted first
    r, v, m = (x.gather(-1, order) for x in (rewards, values, mask))  # (N, L) compacted
    v = torch.where(m > 0, v, torch.zeros_like(v))
    r = torch.where(m > 0, r, torch.zeros_like(r))
    next_v = torch.cat([v[:, 1:] * m[:, 1:], torch.zeros(n, 1, dtype=v.dtype)], dim=-1)
    delta = (r + gamma * next_v - v) * m  # (N, L)
    k = torch.arange(length)
    powers = (k[:, None] - k[None, :]).clamp(min=0).to(v.dtype)
    disc = torch.where(k[:, None] >= k[None, :], (gamma * lam) ** powers, torch.zeros(()))  # (L, L)
    adv_c = delta @ disc  # (N, L): sum_k delta_k (gl)^(k - t)
    adv = torch.zeros_like(adv_c).scatter_(-1, order, adv_c) * mask
    return adv, (adv + values) * mask


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), gamma=st.sampled_from([1.0, 0.99, 0.5]), lam=st.sampled_from([1.0, 0.95, 0.0]))
def test_gae_loop_matches_vectorized_with_holes(seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    n, length = 4, 7
    mask = (torch.rand(n, length, generator=g) > 0.3).double()  # holes = observation tokens
    rewards = torch.randn(n, length, generator=g, dtype=torch.float64)
    values = torch.randn(n, length, generator=g, dtype=torch.float64)
    adv, ret = compute_gae_advantages(rewards, values, mask, gamma, lam, whiten=False)
    ref_adv, ref_ret = gae_vectorized(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)


@pytest.mark.parametrize("whiten", [False, True])
def test_gae_invariant_to_masked_values_and_rewards(whiten):
    g = torch.Generator().manual_seed(1)
    mask = T([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0, 0.0]])
    rewards, values = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    adv, ret = compute_gae_advantages(rewards, values, mask, 0.99, 0.95, whiten=whiten)
    off = mask == 0
    values2 = values.masked_fill(off, float("nan"))  # even NaN under the mask changes nothing
    rewards2 = rewards.masked_fill(off, 123.0)
    adv2, ret2 = compute_gae_advantages(rewards2, values2, mask, 0.99, 0.95, whiten=whiten)
    torch.testing.assert_close(adv, adv2)
    torch.testing.assert_close(ret, ret2)
    assert (adv[off] == 0).all() and (ret[off] == 0).all()


def test_gae_whitened_has_zero_mean_unit_std_over_counted():
    g = torch.Generator().manual_seed(2)
    mask = (torch.rand(8, 6, generator=g) > 0.2).float()
    adv, _ = compute_gae_advantages(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g), mask, 1.0, 0.95)
    counted = adv[mask > 0]
    assert abs(float(counted.mean())) < 1e-5
    assert abs(float(counted.std()) - 1.0) < 1e-4
