"""verl's critic data metrics as mergeable moments (stages/algos/critic_moments.py): golden numbers by hand, and
any cut of the tokens into batches gives the whole batch's numbers."""

from __future__ import annotations

import numpy as np
import pytest

from stages.algos.critic_moments import CriticDataMoments, Moments


def test_golden_by_hand() -> None:
    m = CriticDataMoments()
    m.add(np.array([1.0, 2.0]), np.array([2.0, 4.0]), np.array([1.0, -1.0]))
    m.add(np.array([3.0]), np.array([3.0]), np.array([0.5]))
    out = m.metrics()
    # values 1, 2, 3: mean 2, max 3, min 1; returns 2, 4, 3: mean 3; advantages 1, -1, 0.5: mean 0.5 / 3
    assert out["critic/values/mean"] == 2.0 and out["critic/values/max"] == 3.0 and out["critic/values/min"] == 1.0
    assert out["critic/returns/mean"] == 3.0 and out["critic/advantages/mean"] == pytest.approx(0.5 / 3)
    # Var(returns) unbiased: deviations -1, 1, 0 -> 2 / (3 - 1) = 1; returns - values = 1, 2, 0: mean 1,
    # deviations 0, 1, -1 -> 2 / 2 = 1; explained = 1 - 1 / (1 + 1e-5)
    assert out["critic/vf_explained_var"] == pytest.approx(1.0 - 1.0 / (1.0 + 1e-5), abs=1e-12)


def test_no_token_and_one_token_as_masked_var() -> None:
    empty = CriticDataMoments().metrics()
    assert empty["critic/values/mean"] == 0.0 and empty["critic/values/max"] == 0.0
    assert empty["critic/vf_explained_var"] == 1.0  # masked_var of an empty mask is 0: 1 - 0 / (0 + 1e-5)
    one = CriticDataMoments()
    one.add(np.array([0.5]), np.array([2.0]), np.array([1.0]))
    assert one.metrics()["critic/vf_explained_var"] == 1.0  # a single number's variance is 0 (no Bessel)


def test_batches_merge_to_the_whole() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, 1000)
    whole = Moments()
    whole.add(x)
    for cuts in ([10, 11, 500], [0, 0, 999], [1]):
        parts = Moments()
        for part in np.split(x, cuts):
            parts.add(part)
        assert parts.n == 1000 and parts.var() == pytest.approx(whole.var(), rel=1e-12)
    assert whole.var() == pytest.approx(float(np.var(x, ddof=1)), rel=1e-12)
