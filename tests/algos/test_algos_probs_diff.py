"""verl's rollout-vs-actor probability gap (training/rollout_probs_diff_*), against hand-derived numbers."""

from __future__ import annotations

import math

import pytest
import torch

from stages.algos.probs_diff import (
    PROBS_DIFF_KEYS,
    merge_probs_diff_moments,
    probs_diff_from_moments,
    probs_diff_moments,
    rollout_probs_diff,
)

T = torch.tensor
ln = math.log


def test_probs_diff_hand_derived() -> None:
    # probabilities (old | rollout), mask:
    #   row 0: 0.5 | 0.25, 0.8 | 0.8, (masked)          -> d = 0.25, 0      max 0.25, mean 0.125
    #   row 1: 0.1 | 0.2,  0.9 | 0.6, 0.6 | 0.6         -> d = 0.1, 0.3, 0  max 0.3,  mean 0.4 / 3
    #   row 2: nothing counted                          -> NaN, NaN
    old = T([[ln(0.5), ln(0.8), 0.0], [ln(0.1), ln(0.9), ln(0.6)], [ln(0.3)] * 3])
    rollout = T([[ln(0.25), ln(0.8), -5.0], [ln(0.2), ln(0.6), ln(0.6)], [ln(0.1)] * 3])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    metrics, row_max, row_mean = rollout_probs_diff(old, rollout, mask)
    assert row_max[:2].tolist() == pytest.approx([0.25, 0.3], abs=1e-6) and row_max[2].isnan()
    assert row_mean[:2].tolist() == pytest.approx([0.125, 0.4 / 3], abs=1e-6) and row_mean[2].isnan()
    # the 5 counted d = [0.25, 0, 0.1, 0.3, 0]: max 0.3, mean 0.65 / 5 = 0.13;
    # deviations 0.12, -0.13, -0.03, 0.17, -0.13 -> squares sum 0.078, / (5 - 1) = 0.0195, std = 0.139642
    # Pearson of x = [0.5, 0.8, 0.1, 0.9, 0.6] (mean 0.58) and y = [0.25, 0.8, 0.2, 0.6, 0.6] (mean 0.49):
    #   sum dx dy = 0.264, sum dx^2 = 0.388, sum dy^2 = 0.262 -> 0.264 / sqrt(0.388 * 0.262) = 0.828014
    assert list(metrics) == list(PROBS_DIFF_KEYS)
    assert metrics["training/rollout_probs_diff_valid"] == 1
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.3, abs=1e-6)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(0.13, abs=1e-6)
    assert metrics["training/rollout_probs_diff_std"] == pytest.approx(0.139642, abs=1e-6)
    assert metrics["training/rollout_actor_probs_pearson_corr"] == pytest.approx(0.828014, abs=1e-6)


def test_equal_logprobs_give_zero_gap_and_correlation_one() -> None:
    # old == rollout: d = 0 everywhere; the probabilities 0.5, 0.25 correlate perfectly with themselves
    lp = T([[ln(0.5), ln(0.25)]])
    metrics, row_max, row_mean = rollout_probs_diff(lp, lp.clone(), torch.ones(1, 2))
    assert metrics["training/rollout_probs_diff_max"] == metrics["training/rollout_probs_diff_std"] == 0.0
    assert metrics["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    assert row_max.tolist() == row_mean.tolist() == [0.0]


def test_no_counted_token_is_invalid_and_nan() -> None:
    # verl: valid 0 and NaN for the other four when the response mask is all zero
    metrics, row_max, row_mean = rollout_probs_diff(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert metrics["training/rollout_probs_diff_valid"] == 0
    assert all(math.isnan(metrics[k]) for k in PROBS_DIFF_KEYS[1:])
    assert row_max.isnan().all() and row_mean.isnan().all()


def test_one_counted_token_has_no_spread() -> None:
    # one token 0.5 vs 0.25: max = mean = 0.25; an unbiased std and a correlation of one sample are NaN
    metrics, _, _ = rollout_probs_diff(T([[ln(0.5), 0.0]]), T([[ln(0.25), 0.0]]), T([[1.0, 0.0]]))
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.25, abs=1e-7)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(0.25, abs=1e-7)
    assert math.isnan(metrics["training/rollout_probs_diff_std"])
    assert math.isnan(metrics["training/rollout_actor_probs_pearson_corr"])


def _merged(parts) -> dict[str, float]:
    moments = [probs_diff_moments(*p) for p in parts]
    total = moments[0]
    for m in moments[1:]:
        total = merge_probs_diff_moments(total, m)
    return probs_diff_from_moments(total)


def test_moments_merged_over_ranks_give_the_whole_batch_metrics() -> None:
    # the hand-derived batch above, cut after row 0 (rank 0: d = 0.25, 0; rank 1: d = 0.1, 0.3, 0 and a row with
    # nothing counted): merging the two ranks' moments must give the same five numbers as the whole batch
    # (max 0.3, mean 0.13, std 0.139642, Pearson 0.828014), to float64 rounding
    old = T([[ln(0.5), ln(0.8), 0.0], [ln(0.1), ln(0.9), ln(0.6)], [ln(0.3)] * 3])
    rollout = T([[ln(0.25), ln(0.8), -5.0], [ln(0.2), ln(0.6), ln(0.6)], [ln(0.1)] * 3])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    whole, _, _ = rollout_probs_diff(old, rollout, mask)
    for cut in (1, 2):
        merged = _merged([(old[:cut], rollout[:cut], mask[:cut]), (old[cut:], rollout[cut:], mask[cut:])])
        assert merged == pytest.approx(whole, rel=1e-12, abs=1e-12)
    assert merged["training/rollout_probs_diff_std"] == pytest.approx(0.139642, abs=1e-6)
    # random batches in 1 to 5 uneven parts, empty parts included
    gen = torch.Generator().manual_seed(0)
    old, rollout = -torch.rand(9, 7, generator=gen) * 3, -torch.rand(9, 7, generator=gen) * 3  # (9, 7) log-probs
    mask = (torch.rand(9, 7, generator=gen) > 0.3).double()  # (9, 7)
    whole, _, _ = rollout_probs_diff(old, rollout, mask)
    for cuts in ([9], [0, 9], [2, 2, 9], [1, 4, 6, 8, 9]):
        bounds = list(zip([0, *cuts], cuts, strict=False))
        merged = _merged([(old[a:b], rollout[a:b], mask[a:b]) for a, b in bounds])
        assert merged == pytest.approx(whole, rel=1e-10, abs=1e-12)


def test_moments_of_no_or_one_token_match_the_whole_batch_rules() -> None:
    # nothing counted: valid 0 and NaNs; one token: NaN std and correlation (as rollout_probs_diff)
    none = _merged([(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))] * 2)
    assert none["training/rollout_probs_diff_valid"] == 0 and all(math.isnan(none[k]) for k in PROBS_DIFF_KEYS[1:])
    one = _merged([(T([[ln(0.5), 0.0]]), T([[ln(0.25), 0.0]]), T([[1.0, 0.0]])), (T([[0.0]]), T([[0.0]]), T([[0.0]]))])
    assert one["training/rollout_probs_diff_mean"] == pytest.approx(0.25, abs=1e-7)
    assert math.isnan(one["training/rollout_probs_diff_std"]) and math.isnan(
        one["training/rollout_actor_probs_pearson_corr"]
    )
