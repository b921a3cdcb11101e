"""Outcome and token advantage estimators: hand-derived numbers, invariants, dispatcher."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.algos.advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    compute_grpo_advantages,
    compute_opo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    group_sum,
    outcome_to_token_rewards,
)

T = torch.tensor


def test_grpo_one_group_golden():
    # rewards [1,0,0,1]: mean 0.5, deviations ±0.5, unbiased var = 4*0.25/3 = 1/3,
    # std 0.57735 -> adv = ±0.5/0.57735 = ±0.866025 (eps 1e-6 negligible at atol 1e-5).
    adv = compute_grpo_advantages(T([1.0, 0.0, 0.0, 1.0]), T([0, 0, 0, 0]))
    expect = T([0.866025, -0.866025, -0.866025, 0.866025])
    torch.testing.assert_close(adv, expect, atol=1e-5, rtol=0)


def test_dr_grpo_drops_std_and_singleton_keeps_its_score():
    # Dr.GRPO: r - mean = ±0.5 for group 0; group 5 has one rollout: mean 0 (verl) -> 3 - 0 = 3.
    adv = compute_grpo_advantages(T([1.0, 0.0, 0.0, 1.0, 3.0]), T([0, 0, 0, 0, 5]), scale_by_std=False)
    torch.testing.assert_close(adv, T([0.5, -0.5, -0.5, 0.5, 3.0]))


def test_grpo_singleton_is_score_over_one_plus_eps():
    # one rollout, reward 1: mean 0, std 1 (verl) -> (1 - 0) / (1 + 1e-6) = 0.999999000001;
    # eps 0.5 makes the division visible: 1 / 1.5 = 0.666667. Reward -2: -2 / 1.5 = -1.333333.
    torch.testing.assert_close(compute_grpo_advantages(T([1.0]), T([4])), T([1 / (1 + 1e-6)]), atol=0, rtol=1e-7)
    adv = compute_grpo_advantages(T([1.0, -2.0]), T([4, 9]), eps=0.5)
    torch.testing.assert_close(adv, T([0.666667, -1.333333]), atol=1e-6, rtol=0)


def test_rloo_golden():
    # rewards [1,0,0,0]: A_0 = 1 - mean(0,0,0) = 1; A_j = 0 - mean(1,0,0) = -1/3.
    # Same as (r - 0.25) * 4/3. Group 2 is a singleton: no other member, baseline 0 -> 7 (verl).
    adv = compute_rloo_advantages(T([1.0, 0.0, 0.0, 0.0, 7.0]), T([1, 1, 1, 1, 2]))
    torch.testing.assert_close(adv, T([1.0, -1 / 3, -1 / 3, -1 / 3, 7.0]))


def test_opo_golden():
    # rewards [1,0], lengths [1,3]: b = (1*1 + 3*0) / (1+3) = 0.25 -> adv [0.75, -0.25].
    adv = compute_opo_advantages(T([1.0, 0.0]), T([1.0, 3.0]), T([0, 0]))
    torch.testing.assert_close(adv, T([0.75, -0.25]))


def test_opo_singleton_keeps_its_score():
    # group 3 is one rollout of length 5: verl's baseline is 0, not 5*0.4/5 = 0.4 -> adv 0.4.
    torch.testing.assert_close(compute_opo_advantages(T([0.4]), T([5.0]), T([3])), T([0.4]))


# Mixed batch: a singleton group 7 (reward 2) and a group 3 of three (rewards 1, 0, 0), as a
# filtered or odd-sized batch leaves them. Group 3 statistics: mean 1/3, deviations 2/3, -1/3, -1/3,
# squares 4/9 + 1/9 + 1/9 = 2/3, unbiased var (2/3)/2 = 1/3, std 0.577350.
MIXED_REWARDS, MIXED_IDS, MIXED_LENGTHS = T([2.0, 1.0, 0.0, 0.0]), T([7, 3, 3, 3]), T([4.0, 1.0, 2.0, 3.0])
MIXED_EXPECTED = {
    # singleton 2 / (1 + 1e-6) = 1.999998; group (2/3) / (0.577350 + 1e-6) = 1.154699 and
    # (-1/3) / 0.577351 = -0.577349 (eps moves the 6th decimal: 1.154701 without it).
    "grpo": [1.999998, 1.154699, -0.577349, -0.577349],
    # singleton 2 - 0 = 2; group r - 1/3.
    "dr_grpo": [2.0, 2 / 3, -1 / 3, -1 / 3],
    # singleton 2; group: 1 - mean(0, 0) = 1, 0 - mean(1, 0) = -0.5 twice.
    "rloo": [2.0, 1.0, -0.5, -0.5],
    # singleton baseline 0 -> 2; group b = (1*1 + 2*0 + 3*0) / (1+2+3) = 1/6 -> 5/6, -1/6, -1/6.
    "opo": [2.0, 5 / 6, -1 / 6, -1 / 6],
    # centered [2, 2/3, -1/3, -1/3] (L = 1), whitened over the batch: mean (2 + 0) / 4 = 0.5,
    # deviations 1.5, 1/6, -5/6, -5/6; squares 2.25 + 1/36 + 25/36 + 25/36 = 11/3; unbiased var
    # (11/3)/3 = 11/9, std 1.105542 -> 1.356801, 0.150756, -0.753778, -0.753778.
    "reinforce_plus_plus_baseline": [1.356801, 0.150756, -0.753778, -0.753778],
}
MIXED_FNS = {
    "grpo": lambda: compute_grpo_advantages(MIXED_REWARDS, MIXED_IDS),
    "dr_grpo": lambda: compute_grpo_advantages(MIXED_REWARDS, MIXED_IDS, scale_by_std=False),
    "rloo": lambda: compute_rloo_advantages(MIXED_REWARDS, MIXED_IDS),
    "opo": lambda: compute_opo_advantages(MIXED_REWARDS, MIXED_LENGTHS, MIXED_IDS),
    "reinforce_plus_plus_baseline": lambda: compute_reinforce_plus_plus_baseline_advantages(
        MIXED_REWARDS, MIXED_IDS, torch.ones(4, 1)
    )[:, 0],
}


@pytest.mark.parametrize("name", sorted(MIXED_EXPECTED))
def test_mixed_batch_singleton_keeps_raw_score(name):
    torch.testing.assert_close(MIXED_FNS[name](), T(MIXED_EXPECTED[name]), atol=1e-6, rtol=0)


def test_dispatcher_mixed_batch_grpo():
    # the same mixed batch through compute_advantages: each score on the last of its counted tokens
    # (lengths 1, 2, 1, 3 of L = 3); the scalar advantage is copied onto every counted token.
    mask = T([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = outcome_to_token_rewards(MIXED_REWARDS, mask)
    adv, _ = compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_ids=MIXED_IDS)
    torch.testing.assert_close(adv, T(MIXED_EXPECTED["grpo"])[:, None] * mask, atol=1e-6, rtol=0)


def test_reinforce_plus_plus_golden():
    # one rollout, reward 1 on the last of 3 tokens, gamma 0.5 -> returns [0.25, 0.5, 1].
    # whiten: mean 1.75/3 = 0.583333; deviations -0.333333, -0.083333, 0.416667;
    # squares sum 0.111111 + 0.006944 + 0.173611 = 0.291667; unbiased var 0.145833,
    # std 0.381881 -> adv [-0.872872, -0.218218, 1.091089].
    adv, ret = compute_reinforce_plus_plus_advantages(T([[0.0, 0.0, 1.0]]), torch.ones(1, 3), 0.5)
    torch.testing.assert_close(ret, T([[0.25, 0.5, 1.0]]))
    torch.testing.assert_close(adv, T([[-0.872872, -0.218218, 1.091089]]), atol=1e-5, rtol=0)


def test_reinforce_plus_plus_ignores_masked_tail():
    # mask [1,1,0]: the 5 on the padding token is ignored; gamma 1 -> returns [1, 1, 0].
    _, ret = compute_reinforce_plus_plus_advantages(T([[0.0, 1.0, 5.0]]), T([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(ret, T([[1.0, 1.0, 0.0]]))


def test_reinforce_plus_plus_carries_the_return_across_a_mask_hole():
    # multi-turn: tokens 2-3 are a tool observation (mask 0) inside the response, mask [1,1,0,0,1];
    # reward 1 on the last token and a 5 on an observation token, gamma 0.5. As verl 1dda039:
    #   t=4 counted: G = 1; t=3, t=2 masked: skipped, their 5 ignored, G stays 1 (not discounted);
    #   t=1 counted: G = 0 + 0.5 * 1 = 0.5; t=0: 0.25 -> returns [0.25, 0.5, 0, 0, 1]
    # (restarting at the hole, as rlake did before issue #38, gave [0, 0, 0, 0, 1]).
    # The counted returns are the golden's above, so the whitened advantages are too.
    mask = T([[1.0, 1.0, 0.0, 0.0, 1.0]])
    adv, ret = compute_reinforce_plus_plus_advantages(T([[0.0, 0.0, 5.0, 0.0, 1.0]]), mask, 0.5)
    torch.testing.assert_close(ret, T([[0.25, 0.5, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(adv, T([[-0.872872, -0.218218, 0.0, 0.0, 1.091089]]), atol=1e-5, rtol=0)


def test_reinforce_plus_plus_baseline_golden():
    # groups {0: [1, 0], 1: [1, 1]}, L = 1: centered [0.5, -0.5, 0, 0]; batch whiten over 4
    # tokens: mean 0, unbiased var (0.25+0.25)/3 = 1/6, std 0.408248 -> [1.224745, -1.224745, 0, 0].
    adv = compute_reinforce_plus_plus_baseline_advantages(T([1.0, 0.0, 1.0, 1.0]), T([0, 0, 1, 1]), torch.ones(4, 1))
    torch.testing.assert_close(adv, T([[1.224745], [-1.224745], [0.0], [0.0]]), atol=1e-5, rtol=0)


def test_remax_golden():
    # reward 1 on the last counted token, greedy baseline 0.4: return-to-go [1, 1, 0] under
    # mask [1,1,0]; advantage 1 - 0.4 = 0.6 on counted tokens.
    adv, ret = compute_remax_advantages(T([[0.0, 1.0, 0.0]]), T([0.4]), T([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(ret, T([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(adv, T([[0.6, 0.6, 0.0]]))


def test_outcome_to_token_rewards_last_counted_token():
    # row 0 mask [1,1,0] -> index 1; row 1 [1,0,1] -> index 2; row 2 empty -> all zero.
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    out = outcome_to_token_rewards(T([2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(out, T([[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]))


def test_group_sum():
    torch.testing.assert_close(group_sum(T([1.0, 2.0, 4.0]), T([9, 3, 9])), T([5.0, 2.0, 5.0]))


groups = st.lists(
    st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=2, max_size=6), min_size=1, max_size=6
)


@settings(max_examples=60, deadline=None)
@given(groups)
@pytest.mark.parametrize(
    "fn",
    [
        lambda r, g: compute_grpo_advantages(r, g),
        lambda r, g: compute_grpo_advantages(r, g, scale_by_std=False),
        compute_rloo_advantages,
    ],
)
def test_group_advantages_sum_to_zero(fn, groups):
    rewards = torch.tensor([x for grp in groups for x in grp], dtype=torch.float64)
    ids = torch.tensor([i for i, grp in enumerate(groups) for _ in grp])
    adv = fn(rewards, ids)
    sums = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, ids, adv)
    torch.testing.assert_close(sums, torch.zeros_like(sums), atol=1e-6, rtol=0)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, length = 6, 5
    lengths = T([5, 3, 1, 4, 2, 5])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()  # (N, L)
    scores = torch.randint(0, 2, (n,), generator=g).float()
    return dict(
        token_level_rewards=outcome_to_token_rewards(scores, mask),
        response_mask=mask,
        group_ids=T([0, 0, 0, 1, 1, 1]),
        values=torch.randn(n, length, generator=g),
        baseline_rewards=torch.rand(n, generator=g),
    )


def test_registry_names_are_verls():
    assert set(ADV_ESTIMATORS) == {
        "gae",
        "grpo",
        "rloo",
        "opo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
    }


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_every_estimator_zero_under_mask_and_finite(name):
    b = _batch()
    adv, ret = compute_advantages(name, **b, gamma=0.9, lam=0.95)
    assert adv.shape == ret.shape == b["response_mask"].shape
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    off = b["response_mask"] == 0
    assert (adv[off] == 0).all() and (ret[off] == 0).all()


def test_dispatcher_grpo_matches_outcome_function():
    b = _batch()
    adv, ret = compute_advantages("grpo", **b, norm_adv_by_std_in_grpo=False)
    scores = b["token_level_rewards"].sum(-1)
    expect = compute_grpo_advantages(scores, b["group_ids"], scale_by_std=False)[:, None]
    torch.testing.assert_close(adv, expect * b["response_mask"])
    torch.testing.assert_close(ret, adv)


def test_dispatcher_errors_name_the_fix():
    b = _batch()
    with pytest.raises(ValueError, match=r"Unknown adv_estimator 'ppo'.*'gae'"):
        compute_advantages("ppo", **b)
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages("gae", token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"])
    with pytest.raises(ValueError, match="needs group_ids"):
        compute_advantages("rloo", token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"])
    with pytest.raises(ValueError, match="needs baseline_rewards"):
        compute_advantages("remax", token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"])
