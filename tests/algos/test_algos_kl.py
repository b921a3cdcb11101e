"""KL estimators, KL-in-reward, KL controllers."""

from __future__ import annotations

import math
import re

import pytest
import torch

from stages.algos.kl import KL_ESTIMATORS, apply_kl_penalty, compute_kl_penalty
from stages.algos.kl_ctrl import AdaptiveKLController, FixedKLController, make_kl_controller

T = torch.tensor
LN2 = math.log(2)

# log r = +ln 2:  k1 = 0.693147, abs = 0.693147, k2 = 0.5 * 0.480453 = 0.240227,
#                 k3 = e^-ln2 - 1 + ln2 = 0.5 - 1 + 0.693147 = 0.193147.
# log r = -ln 2:  k1 = -0.693147, abs = 0.693147, k2 = 0.240227, k3 = 2 - 1 - 0.693147 = 0.306853.
KL_GOLDEN = {
    "k1": (LN2, -LN2),
    "kl": (LN2, -LN2),
    "abs": (LN2, LN2),
    "k2": (0.240227, 0.240227),
    "mse": (0.240227, 0.240227),
    "k3": (0.193147, 0.306853),
    "low_var_kl": (0.193147, 0.306853),
}


@pytest.mark.parametrize("kind", sorted(KL_GOLDEN))
def test_kl_estimators_at_log_ratio_ln2(kind):
    logprobs, ref = T([[0.0, -LN2]]), T([[-LN2, 0.0]])  # log r = [+ln2, -ln2]
    torch.testing.assert_close(compute_kl_penalty(logprobs, ref, kind), T([KL_GOLDEN[kind]]), atol=1e-6, rtol=0)


def test_k3_is_clamped_to_10():
    # log r = -20: e^20 - 1 - 20 = 4.85e8 -> 10;  log r = 20: e^-20 - 1 + 20 = 19.0 -> 10.
    out = compute_kl_penalty(T([[-20.0, 20.0]]), torch.zeros(1, 2), "low_var_kl")
    torch.testing.assert_close(out, T([[10.0, 10.0]]))


def test_full_kl_from_distributions():
    # p = [0.5, 0.5], q = [0.25, 0.75]: KL = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75)
    # = 0.346574 - 0.202733 = 0.143841.
    p, q = T([[[0.5, 0.5]]]).log(), T([[[0.25, 0.75]]]).log()  # (N=1, L=1, V=2)
    torch.testing.assert_close(compute_kl_penalty(p, q, "full"), T([[0.143841]]), atol=1e-6, rtol=0)


def test_k3_gradient_is_its_own_and_finite_far_out():
    # d/dlogp (e^-x - 1 + x) with x = log r = 1 - e^-x: x = +ln2 -> 1 - 0.5 = 0.5; x = -ln2 -> 1 - 2 = -1.
    # x = -100: the value is clamped to 10, so the gradient is 0 (x is clamped to [-20, 20] before
    # exp; exp(100) overflows float32 and would give 0 * inf = NaN).
    logprobs = T([[0.0, -LN2, -100.0]], requires_grad=True)
    compute_kl_penalty(logprobs, T([[-LN2, 0.0, 0.0]]), "k3").sum().backward()
    torch.testing.assert_close(logprobs.grad, T([[0.5, -1.0, 0.0]]))


# Straight-through "+": value of the named estimator (KL_GOLDEN), gradient of k2 = 0.5 (logp - ref)^2,
# d/dlogp = logp - ref = log r -> [+ln2, -ln2] = [0.693147, -0.693147], d/dref = -log r.
@pytest.mark.parametrize("kind", sorted(KL_GOLDEN))
def test_straight_through_value_of_named_gradient_of_k2(kind):
    logprobs = T([[0.0, -LN2]], requires_grad=True)
    ref = T([[-LN2, 0.0]], requires_grad=True)
    out = compute_kl_penalty(logprobs, ref, f"{kind}+")
    torch.testing.assert_close(out, T([KL_GOLDEN[kind]]), atol=1e-6, rtol=0)
    out.sum().backward()
    torch.testing.assert_close(logprobs.grad, T([[LN2, -LN2]]))
    torch.testing.assert_close(ref.grad, T([[-LN2, LN2]]))


def test_straight_through_names_are_verls():
    # verl strips one trailing "+" from any sampled-token name; k2+ / mse+ equal k2; no full+.
    plus = {k for k in KL_ESTIMATORS if k.endswith("+")}
    assert plus == {"k1+", "kl+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+"}
    assert "full" in KL_ESTIMATORS


@pytest.mark.parametrize("kind", ["k4", "k4+", "full+", "k3++", "+"])
def test_unknown_kl_kind(kind):
    with pytest.raises(ValueError, match=rf"Unknown KL estimator '{re.escape(kind)}'.*low_var_kl"):
        compute_kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), kind)


def test_apply_kl_penalty_golden():
    # row 0: k1 = [0.1, 0.3, 9 (masked)], score 1 on its last counted token (index 1);
    # row 1: k1 = 0.4 everywhere, score 0.  beta = 0.5:
    # rewards row 0 = [-0.05, 1 - 0.15, 0] = [-0.05, 0.85, 0]; row 1 = [-0.2, -0.2, -0.2].
    # current KL = mean(row means) = mean(0.2, 0.4) = 0.3.
    scores = T([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    logprobs = T([[0.1, 0.3, 9.0], [0.4, 0.4, 0.4]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards, m = apply_kl_penalty(scores, logprobs, torch.zeros(2, 3), mask, 0.5, "k1")
    torch.testing.assert_close(rewards, T([[-0.05, 0.85, 0.0], [-0.2, -0.2, -0.2]]))
    assert m["actor/reward_kl_penalty"] == pytest.approx(0.3)
    assert m["actor/reward_kl_penalty_coeff"] == 0.5


def test_apply_kl_penalty_straight_through_gives_the_named_value():
    # in the reward (no_grad) k3+ is k3: log r = +ln2 -> 0.193147, -ln2 -> 0.306853 (KL_GOLDEN);
    # beta 1, scores 0 -> rewards [-0.193147, -0.306853]; KL metric = row mean = 0.25.
    logprobs = T([[0.0, -LN2]], requires_grad=True)
    rewards, m = apply_kl_penalty(torch.zeros(1, 2), logprobs, T([[-LN2, 0.0]]), torch.ones(1, 2), 1.0, "k3+")
    torch.testing.assert_close(rewards, T([[-0.193147, -0.306853]]), atol=1e-6, rtol=0)
    assert not rewards.requires_grad
    assert m["actor/reward_kl_penalty"] == pytest.approx(0.25, abs=1e-6)


def test_adaptive_kl_controller_numbers():
    # beta 0.2, target 0.1, horizon 1000, n_steps 100:
    # KL 0.11 -> e = 0.11/0.1 - 1 = 0.1, mult 1 + 0.1*100/1000 = 1.01 -> 0.202;
    # KL 0.5  -> e = 4 clipped to 0.2, mult 1.02 -> 0.20604;
    # KL 0.0  -> e = -1 clipped to -0.2, mult 0.98 -> 0.2019192.
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=1000)
    for kl, expect in [(0.11, 0.202), (0.5, 0.20604), (0.0, 0.2019192)]:
        ctrl.update(kl, n_steps=100)
        assert ctrl.value == pytest.approx(expect, rel=1e-9)


def test_fixed_kl_controller_and_factory():
    ctrl = make_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(10.0, 1000)
    assert ctrl.value == 0.05
    assert isinstance(make_kl_controller("adaptive", kl_coef=0.05), AdaptiveKLController)
    with pytest.raises(ValueError, match=r"Unknown KL controller 'pid'.*'fixed', 'adaptive'"):
        make_kl_controller("pid", kl_coef=0.05)
    with pytest.raises(ValueError, match="horizon > 0"):
        AdaptiveKLController(0.05, 0.1, 0)
