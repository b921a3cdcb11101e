"""Rollout correction (verl's algorithm.rollout_correction): importance weights, rejection masks, their metrics
and the weighted policy loss, on one toy batch with numbers derived by hand.

The batch: 2 rollouts x 3 tokens, the last token of row 1 is padding. rollout_logprobs = -1 everywhere and
old_logprobs = -1 + log r, so the trainer-over-engine ratios are
    row 0: r = [3, 1, 0.6]    (all counted)
    row 1: r = [1.5, 0.25, e^2]  (e^2 is padding: it must never count)
Products over the counted tokens: row 0 3 * 1 * 0.6 = 1.8, row 1 1.5 * 0.25 = 0.375.
"""

from __future__ import annotations

import math

import pytest
import torch

from stages.algos.losses import compute_policy_loss, compute_policy_loss_gspo
from stages.algos.rollout_is import (
    batch_normalize_weights,
    compute_offpolicy_metrics,
    compute_rollout_correction,
    compute_rollout_is_weights,
    compute_rollout_rs_mask,
    rollout_is_norm_terms,
)

P = "rollout_corr/"


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ratios = torch.tensor([[3.0, 1.0, 0.6], [1.5, 0.25, math.exp(2.0)]])
    rollout = torch.full((2, 3), -1.0)
    old = rollout + ratios.log()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return old, rollout, mask


def _close(got: float, want: float) -> None:
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_token_tis_weights_and_metrics() -> None:
    # upper 2: weights min(r, 2) = [2, 1, 0.6] / [1.5, 0.25, 0 (padding)]
    old, rollout, mask = _batch()
    w, m = compute_rollout_is_weights(old, rollout, mask, level="token", upper=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.6], [1.5, 0.25, 0.0]]))
    assert not w.requires_grad
    # mean over 5 counted tokens: (2 + 1 + 0.6 + 1.5 + 0.25) / 5 = 5.35 / 5 = 1.07; max 2, min 0.25
    _close(m[P + "rollout_is_mean"], 1.07)
    _close(m[P + "rollout_is_max"], 2.0)
    _close(m[P + "rollout_is_min"], 0.25)
    # raw ratios above 2: {3} -> 1/5; below 1/2: {0.25} -> 1/5
    _close(m[P + "rollout_is_ratio_fraction_high"], 0.2)
    _close(m[P + "rollout_is_ratio_fraction_low"], 0.2)
    # E[w^2] = (4 + 1 + 0.36 + 2.25 + 0.0625) / 5 = 1.5345; var = 1.5345 - 1.07^2 = 0.3896
    _close(m[P + "rollout_is_std"], math.sqrt(0.3896))
    # ESS = 1 / E[(w / mean)^2] = mean^2 / E[w^2] = 1.1449 / 1.5345
    _close(m[P + "rollout_is_eff_sample_size"], 1.1449 / 1.5345)
    # per-rollout means: (2 + 1 + 0.6) / 3 = 1.2 and (1.5 + 0.25) / 2 = 0.875
    _close(m[P + "rollout_is_seq_mean"], (1.2 + 0.875) / 2)
    _close(m[P + "rollout_is_seq_std"], 0.325 / math.sqrt(2))  # unbiased std of two values: |a - b| / sqrt 2
    _close(m[P + "rollout_is_seq_max"], 1.2)
    _close(m[P + "rollout_is_seq_min"], 0.875)
    _close(m[P + "rollout_is_seq_max_deviation"], 0.2)  # |1.2 - 1|
    # raw per-rollout means 4.6 / 3 = 1.533 and 0.875: none above 2 or below 0.5
    assert m[P + "rollout_is_seq_fraction_high"] == 0.0 and m[P + "rollout_is_seq_fraction_low"] == 0.0


def test_sequence_tis_truncates_the_product() -> None:
    # products 1.8 and 0.375 on every counted token; upper 1.5 truncates row 0 to 1.5
    old, rollout, mask = _batch()
    w, m = compute_rollout_is_weights(old, rollout, mask, level="sequence", upper=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [0.375, 0.375, 0.0]]))
    _close(m[P + "rollout_is_mean"], (3 * 1.5 + 2 * 0.375) / 5)  # 1.05
    _close(m[P + "rollout_is_max"], 1.8)  # sequence level: the raw product
    _close(m[P + "rollout_is_min"], 0.375)
    _close(m[P + "rollout_is_ratio_fraction_high"], 0.5)  # 1.8 > 1.5: one rollout of two
    _close(m[P + "rollout_is_ratio_fraction_low"], 0.5)  # 0.375 < 1 / 1.5


def test_icepop_zeroes_weights_outside_the_bounds() -> None:
    # bounds [0.5, 2]: 3 and 0.25 fall outside -> [0, 1, 0.6] / [1.5, 0, 0]; the others keep their value
    old, rollout, mask = _batch()
    w, m = compute_rollout_is_weights(old, rollout, mask, level="token", upper=2.0, lower=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.6], [1.5, 0.0, 0.0]]))
    _close(m[P + "rollout_is_oob_ratio"], 0.4)  # 2 of 5 counted tokens
    _close(m[P + "rollout_is_mean"], 3.1 / 5)


def test_batch_normalize_divides_by_the_batch_mean() -> None:
    old, rollout, mask = _batch()
    w, _ = compute_rollout_is_weights(old, rollout, mask, level="token", upper=2.0)
    terms = rollout_is_norm_terms(w, mask, "token")  # [5.35, 5]: token mean 1.07
    torch.testing.assert_close(terms, torch.tensor([5.35, 5.0], dtype=torch.float64))
    normed, m = batch_normalize_weights(w, terms)
    torch.testing.assert_close(normed, w / 1.07)
    _close(m[P + "rollout_is_batch_norm_factor"], 1.07)
    # sequence level: mean over non-empty rollouts of their token means 1.5 and 0.375 -> 0.9375
    ws, _ = compute_rollout_is_weights(old, rollout, mask, level="sequence", upper=1.5)
    torch.testing.assert_close(
        rollout_is_norm_terms(ws, mask, "sequence"), torch.tensor([1.875, 2.0], dtype=torch.float64)
    )


def test_token_mask_rejects_tokens_outside_the_ratio_bounds() -> None:
    # token_k1 with bounds [0.5, 2]: r = 3 and r = 0.25 leave the mask (the padding stays 0)
    old, rollout, mask = _batch()
    new, m = compute_rollout_rs_mask(old, rollout, mask, {"token_k1": (0.5, 2.0)})
    torch.testing.assert_close(new, torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
    _close(m[P + "rollout_rs_masked_fraction"], 0.4)  # 2 of 5 counted tokens
    _close(m[P + "rollout_rs_seq_masked_fraction"], 1.0)  # both rollouts lost a token
    _close(m[P + "rollout_rs_token_k1_fraction_high"], 0.2)  # k1 = -log r > log 2 <=> r < 0.5: {0.25}


def test_geometric_mask_rejects_whole_rollouts() -> None:
    # seq_mean_k1 with threshold 1.5 (bounds [1/1.5, 1.5] on the geometric mean of 1/r):
    # row 0: (1/1.8)^(1/3) = 0.822 kept; row 1: (1/0.375)^(1/2) = 1.633 > 1.5 rejected, every token
    old, rollout, mask = _batch()
    new, m = compute_rollout_rs_mask(old, rollout, mask, {"seq_mean_k1": (1 / 1.5, 1.5)})
    torch.testing.assert_close(new, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    _close(m[P + "rollout_rs_seq_mean_k1_seq_max"], -math.log(0.375) / 2)  # the statistic is mean(-log r)
    _close(m[P + "rollout_rs_seq_mean_k1_seq_min"], -math.log(1.8) / 3)
    _close(m[P + "rollout_rs_masked_fraction"], 0.4)
    _close(m[P + "rollout_rs_seq_masked_fraction"], 0.5)


def test_max_criterion_veto_ignores_padding() -> None:
    # seq_max_k2: k2 = (log r)^2 / 2; row 0 max (ln 3)^2 / 2 = 0.6035; row 1 max (ln 4)^2 / 2 = 0.9609 over its
    # counted tokens (the padding's (ln e^2)^2 / 2 = 2 does not count)
    old, rollout, mask = _batch()
    kept, _ = compute_rollout_rs_mask(old, rollout, mask, {"seq_max_k2": (None, 1.0)})
    torch.testing.assert_close(kept, mask)  # 2 > 1.0 only on padding: nothing vetoed
    vetoed, m = compute_rollout_rs_mask(old, rollout, mask, {"seq_max_k2": (None, 0.7)})
    torch.testing.assert_close(vetoed, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    _close(m[P + "rollout_rs_seq_max_k2_max"], math.log(4.0) ** 2 / 2)
    # options AND together: token_k1 [0.5, 2] and the veto at 0.7 leave row 0's tokens 1 and 2
    both, _ = compute_rollout_rs_mask(old, rollout, mask, {"token_k1": (0.5, 2.0), "seq_max_k2": (None, 0.7)})
    torch.testing.assert_close(both, torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_offpolicy_metrics() -> None:
    old, rollout, mask = _batch()
    m = compute_offpolicy_metrics(old, rollout, mask)
    # kl = mean(rollout - old) = -ln(3 * 1 * 0.6 * 1.5 * 0.25) / 5 = -ln(0.675) / 5
    _close(m[P + "kl"], -math.log(0.675) / 5)
    # chi2_token = E[r^2] - 1 = (9 + 1 + 0.36 + 2.25 + 0.0625) / 5 - 1 = 1.5345
    _close(m[P + "chi2_token"], 1.5345)
    # chi2_seq = mean((prod r)^2) - 1 = (1.8^2 + 0.375^2) / 2 - 1 = 0.6903125
    _close(m[P + "chi2_seq"], 0.6903125)
    # training_log_ppl = mean over rollouts of -mean(old): row 0 1 - ln(1.8)/3, row 1 1 - ln(0.375)/2
    _close(m[P + "training_log_ppl"], 1 - (math.log(1.8) / 3 + math.log(0.375) / 2) / 2)
    _close(m[P + "rollout_log_ppl"], 1.0)


def test_combined_entry_point_is_the_sum_of_its_parts() -> None:
    old, rollout, mask = _batch()
    w, new, m = compute_rollout_correction(
        old, rollout, mask, rollout_is="token", is_bounds=(None, 2.0), rs_bounds={"token_k1": (0.5, 2.0)}
    )
    torch.testing.assert_close(w, compute_rollout_is_weights(old, rollout, mask, upper=2.0)[0])
    torch.testing.assert_close(new, compute_rollout_rs_mask(old, rollout, mask, {"token_k1": (0.5, 2.0)})[0])
    assert P + "rollout_is_mean" in m and P + "rollout_rs_masked_fraction" in m and P + "kl" in m
    w_off, same, m_off = compute_rollout_correction(old, rollout, mask)  # nothing on: metrics only
    assert w_off is None and same is mask and not any("rollout_is" in k or "rollout_rs" in k for k in m_off)


def _loss_inputs() -> tuple[torch.Tensor, ...]:
    logprobs = torch.full((2, 3), -0.7, requires_grad=True)
    old = logprobs.detach().clone()  # ratio exactly 1: no clipping
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logprobs, old, adv, mask


def test_weighted_loss_is_the_hand_weighted_token_mean() -> None:
    # per-token loss -A * ratio = -A; times w = [2, 1, 0.6] / [1.5, 0.25, 0]:
    # token-mean = (-(2 + 1 + 0.6) + (1.5 + 0.25)) / 5 = -1.85 / 5 = -0.37; d loss / d logprob = -A * w / 5
    logprobs, old, adv, mask = _loss_inputs()
    w = torch.tensor([[2.0, 1.0, 0.6], [1.5, 0.25, 0.0]])
    loss, m = compute_policy_loss(old, logprobs, adv, mask, rollout_is_weights=w)
    _close(float(loss.detach()), -0.37)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -adv * w * mask / 5)
    assert m["actor/pg_clipfrac"] == 0.0
    # GSPO: seq-mean-token-mean of the weighted loss: (-3.6 / 3 + 1.75 / 2) / 2 = (-1.2 + 0.875) / 2 = -0.1625
    logprobs, old, adv, mask = _loss_inputs()
    loss_gspo, _ = compute_policy_loss_gspo(old, logprobs, adv, mask, rollout_is_weights=w)
    _close(float(loss_gspo.detach()), -0.1625)


@pytest.mark.parametrize("fn", [compute_policy_loss, compute_policy_loss_gspo], ids=["vanilla", "gspo"])
def test_no_weights_is_bit_identical_and_unit_weights_too(fn) -> None:
    torch.manual_seed(0)
    logprobs = torch.randn(4, 5, requires_grad=True)
    old, adv = logprobs.detach() + 0.1 * torch.randn(4, 5), torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    base, _ = fn(old, logprobs, adv, mask)
    off, _ = fn(old, logprobs, adv, mask, rollout_is_weights=None)
    ones, _ = fn(old, logprobs, adv, mask, rollout_is_weights=torch.ones(4, 5))
    assert torch.equal(base, off) and torch.equal(base, ones)
