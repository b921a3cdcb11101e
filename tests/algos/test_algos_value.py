"""Clipped value loss: hand-derived numbers, gradients, masking."""

from __future__ import annotations

import pytest
import torch

from stages.algos.value import compute_value_loss

T = torch.tensor

# One token per case, cliprange_value 0.2: (vpred, old value, return, loss, clipfrac, grad).
VALUE_CASES = [
    # V 0.5 moved 0.5 from V_old 0 -> clipped 0.2; errors (0.5-1)^2 = 0.25, (0.2-1)^2 = 0.64;
    # max 0.64 -> loss 0.5*0.64 = 0.32, clipfrac 1, grad 0 (the clipped branch is constant).
    (0.5, 0.0, 1.0, 0.32, 1.0, 0.0),
    # V 0.1 inside the band: both errors 0.81 -> loss 0.405, clipfrac 0, grad (0.1-1) = -0.9.
    (0.1, 0.0, 1.0, 0.405, 0.0, -0.9),
    # V -0.5 -> clipped -0.2; errors 2.25 vs 1.44 -> unclipped 2.25 wins: loss 1.125,
    # clipfrac 0, grad (-0.5-1) = -1.5.
    (-0.5, 0.0, 1.0, 1.125, 0.0, -1.5),
]


@pytest.mark.parametrize("vpred,old,ret,loss_e,clipfrac_e,grad_e", VALUE_CASES)
def test_value_loss_golden(vpred, old, ret, loss_e, clipfrac_e, grad_e):
    vpreds = T([[vpred]], requires_grad=True)
    loss, m = compute_value_loss(vpreds, T([[ret]]), T([[old]]), torch.ones(1, 1), 0.2)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(loss_e, rel=1e-6)
    assert m["critic/vf_loss"] == pytest.approx(loss_e, rel=1e-6)
    assert m["critic/vf_clipfrac"] == clipfrac_e
    assert float(vpreds.grad) == pytest.approx(grad_e, abs=1e-6)


def test_value_loss_masked_tokens_change_nothing():
    g = torch.Generator().manual_seed(0)
    v, r, o = (torch.randn(2, 4, generator=g) for _ in range(3))
    mask = T([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    off = mask == 0
    out = []
    for vp, rt, ov in [(v, r, o), (v.masked_fill(off, 9.0), r.masked_fill(off, -9.0), o.masked_fill(off, 4.0))]:
        vpreds = vp.clone().requires_grad_(True)
        loss, _ = compute_value_loss(vpreds, rt, ov, mask, 0.2, "seq-mean-token-mean")
        loss.backward()
        out.append((loss.detach(), vpreds.grad))
    torch.testing.assert_close(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1])
    assert (out[0][1][off] == 0).all()


def test_value_inside_a_wide_band_is_never_counted_as_clipped():
    """The clipped prediction of a value inside the band is the value itself, bit for bit.

    Computing it as old + (v - old) rounds: for these 1000 random float32 pairs it differs from v in
    about 22% of tokens and made (clipped error > unclipped error) true for about 9% of them, a
    clipfrac that depended on float noise (it failed a test on another BLAS build). With
    cliprange_value = 100 nothing moves that far, so clipfrac is exactly 0 and the loss is exactly
    0.5 * mean((v - r)^2).
    """
    g = torch.Generator().manual_seed(0)
    old = torch.rand(1, 1000, generator=g) * 3
    v = torch.randn(1, 1000, generator=g) * 5
    r = torch.randn(1, 1000, generator=g)
    loss, m = compute_value_loss(v, r, old, torch.ones(1, 1000), 100.0)
    assert m["critic/vf_clipfrac"] == 0.0
    assert float(loss) == float(0.5 * (v - r).square().mean())
