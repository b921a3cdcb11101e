"""Validation metrics (stages.algos.val_metrics): verl's mean/std/best/worst/maj@n, bootstrap and names."""

from __future__ import annotations

import numpy as np
import pytest

from stages.algos.val_metrics import (
    bootstrap_indices,
    majority_values,
    process_validation_metrics,
    prompt_metrics,
    subset_sizes,
    val_metric_names,
)


def test_subset_sizes_are_powers_of_two_then_n():
    assert subset_sizes(2) == [2]
    assert subset_sizes(5) == [2, 4, 5]
    assert subset_sizes(8) == [2, 4, 8]


def test_bootstrap_indices_are_verls_reseeded_global_draws():
    # verl: np.random.seed(42) then np.random.choice(n, size=k) once per draw
    np.random.seed(42)
    loop = np.stack([np.random.choice(5, size=4, replace=True) for _ in range(1000)])
    assert np.array_equal(bootstrap_indices(5, 4), loop)
    # the first 4 draws of 2 out of 2 at seed 42, used by the golden test below
    assert bootstrap_indices(2, 2, n_bootstrap=4).tolist() == [[0, 1], [0, 0], [0, 1], [0, 0]]


def test_majority_first_top_vote_and_its_first_value():
    votes = np.array([[0, 1, 1], [2, 0, 2], [0, 1, 2], [1, 0, 0]])  # codes of the preds
    values = np.array([[9.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [1.0, 0.5, 0.25]])
    # row 0: vote 1 twice -> its first member, value 1.0; row 1: vote 2 twice -> first member, 3.0
    # row 2: all once, a tie -> the first member's vote wins, 6.0; row 3: vote 0 twice -> member 1, 0.5
    assert majority_values(values, votes).tolist() == [1.0, 3.0, 6.0, 0.5]


def test_prompt_metrics_golden_two_responses_four_draws():
    # values [1, 0]; the four draws of size 2 at seed 42 are [0,1] [0,0] [0,1] [0,0] (see above)
    # mean@2 = 0.5, std@2 = population std of {1, 0} = 0.5
    # subset values: [1,0] [1,1] [1,0] [1,1]: max 1,1,1,1 -> best@2 mean 1, std 0
    #                                          min 0,1,0,1 -> worst@2 mean 0.5, std 0.5
    # preds ["7", "5"] (codes 0, 1): [7,5] tie -> first, value 1; [7,7] -> 1; so maj@2 = 1, std 0
    m = prompt_metrics(np.array([1.0, 0.0]), np.array([0, 1]), n_bootstrap=4)
    assert m == {
        "mean@2": 0.5,
        "std@2": 0.5,
        "best@2/mean": 1.0,
        "best@2/std": 0.0,
        "worst@2/mean": 0.5,
        "worst@2/std": 0.5,
        "maj@2/mean": 1.0,
        "maj@2/std": 0.0,
    }
    assert prompt_metrics(np.array([0.25]), None) == {"mean@1": 0.25}  # n = 1: no std, no bootstrap


def test_prompt_metrics_bootstrap_expectations():
    # values [1, 0, 0] with preds [a, b, b], 1000 draws of 3 with replacement, p(a) = 1/3:
    #   best@3 = 1 unless no a is drawn: 1 - (2/3)^3 = 19/27 = 0.704
    #   worst@3 = 1 only if all three are a: (1/3)^3 = 1/27 = 0.037
    #   maj@3 = 1 when a is drawn at least twice: 3 (1/3)^2 (2/3) + (1/3)^3 = 7/27 = 0.259 (no ties of 3 among 2)
    #   best@2 = 1 - (2/3)^2 = 5/9 = 0.556
    # the binomial std of a mean of 1000 draws is at most 0.016, so 0.05 is > 3 sigma
    m = prompt_metrics(np.array([1.0, 0.0, 0.0]), np.array([0, 1, 1]))
    assert m["mean@3"] == pytest.approx(1 / 3) and m["std@3"] == pytest.approx(np.sqrt(2) / 3)
    assert m["best@3/mean"] == pytest.approx(19 / 27, abs=0.05)
    assert m["worst@3/mean"] == pytest.approx(1 / 27, abs=0.05)
    assert m["maj@3/mean"] == pytest.approx(7 / 27, abs=0.05)
    assert m["best@2/mean"] == pytest.approx(5 / 9, abs=0.05)
    p = m["best@3/mean"]  # a {0,1} statistic: its std is sqrt(p (1 - p))
    assert m["best@3/std"] == pytest.approx(np.sqrt(p * (1 - p)))


def _verl_loop(values: list[float], preds: list[str], k: int) -> tuple[float, float, float]:
    """Means of best, worst, maj over verl's 1000 draws, one draw at a time with dict voting."""
    np.random.seed(42)
    best, worst, maj = [], [], []
    for _ in range(1000):
        idx = np.random.choice(len(values), size=k, replace=True)
        best.append(max(values[i] for i in idx))
        worst.append(min(values[i] for i in idx))
        groups: dict[str, list[float]] = {}
        for i in idx:
            groups.setdefault(preds[i], []).append(values[i])
        top = max(groups, key=lambda p: len(groups[p]))  # first inserted among the most frequent
        maj.append(groups[top][0])
    return float(np.mean(best)), float(np.mean(worst)), float(np.mean(maj))


@pytest.mark.parametrize("n", [3, 6, 8])
def test_vectorized_equals_one_draw_at_a_time(n):
    rng = np.random.default_rng(n)
    values = rng.random(n).round(2).tolist()
    preds = [str(p) for p in rng.integers(0, 3, n)]
    m = prompt_metrics(np.array(values), np.unique(preds, return_inverse=True)[1])
    for k in subset_sizes(n):
        best, worst, maj = _verl_loop(values, preds, k)
        assert (m[f"best@{k}/mean"], m[f"worst@{k}/mean"]) == pytest.approx((best, worst), abs=1e-12)
        assert m[f"maj@{k}/mean"] == pytest.approx(maj, abs=1e-12)


def test_process_and_names_split_as_verl():
    # source "a": prompts p (rewards 1, 0) and q (1, 1); acc present -> acc is the core variable
    # mean@2 of acc: (0.5 + 1) / 2 = 0.75; std@2: (0.5 + 0) / 2 = 0.25
    data_sources = ["a", "a", "a", "a", "b"]
    uids = ["p", "p", "q", "q", "r"]
    infos = {
        "reward": [1.0, 0.0, 1.0, 1.0, 0.5],
        "acc": [True, False, True, True, False],
        "pred": ["7", "5", "7", "7", None],
    }
    nested = process_validation_metrics(data_sources, uids, infos)
    assert set(nested["a"]) == {"reward", "acc"}  # pred is a string: no metrics of its own
    assert nested["a"]["acc"]["mean@2"] == 0.75 and nested["a"]["acc"]["std@2"] == 0.25
    assert nested["b"]["reward"] == {"mean@1": 0.5} and nested["b"]["acc"] == {"mean@1": 0.0}
    flat = val_metric_names(nested)
    core = sorted(k for k in flat if k.startswith("val-core/"))
    assert core == [  # best@n and maj@n with their /std: verl tests the name's prefix and its "@n"
        "val-core/a/acc/best@2/mean",
        "val-core/a/acc/best@2/std",
        "val-core/a/acc/maj@2/mean",
        "val-core/a/acc/maj@2/std",
        "val-core/a/acc/mean@2",
        "val-core/b/acc/mean@1",
    ]
    assert "val-aux/a/reward/mean@2" in flat and "val-aux/a/acc/worst@2/mean" in flat
    assert "val-aux/a/acc/std@2" in flat and "val-aux/b/reward/mean@1" in flat
    # without acc the reward is core, and with n = 4 only K = 4 is core (K = 2 is aux)
    nested = process_validation_metrics(["d"] * 4, ["u"] * 4, {"reward": [1.0, 0.0, 0.0, 1.0]})
    flat = val_metric_names(nested)
    assert sorted(k for k in flat if k.startswith("val-core/")) == [
        "val-core/d/reward/best@4/mean",
        "val-core/d/reward/best@4/std",
        "val-core/d/reward/mean@4",
    ]
    assert "val-aux/d/reward/best@2/mean" in flat and "val-aux/d/reward/std@4" in flat
