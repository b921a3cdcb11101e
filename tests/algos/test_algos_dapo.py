"""DAPO dynamic-sampling filter and overlong penalty."""

from __future__ import annotations

import pytest
import torch

from stages.algos.dapo import filter_groups_by_variance, overlong_reward_penalty

T = torch.tensor


def test_filter_groups_by_variance():
    # group 7: [1,1,1] all equal -> drop; group 3: [0,0] -> drop; group 9: [1,0] -> keep;
    # group 5: [0.5] singleton -> drop (kept with keep_singletons, as verl does).
    scores = T([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5])
    ids = T([7, 7, 7, 3, 3, 9, 9, 5])
    keep = filter_groups_by_variance(scores, ids)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False] * 5 + [True, True, False]
    assert filter_groups_by_variance(scores, ids, keep_singletons=True).tolist()[-1] is True


def test_overlong_penalty_golden():
    # L_max 20, L_cache 4 -> ramp starts after 16 tokens: (16 - |y|)/4, floored at -1 past 20.
    # |y| = 10, 16, 17, 18, 20, 25 -> 0, 0, -0.25, -0.5, -1, -1; factor 0.5 halves them.
    lengths = T([10, 16, 17, 18, 20, 25])
    torch.testing.assert_close(overlong_reward_penalty(lengths, 20, 4), T([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_reward_penalty(lengths, 20, 4, 0.5), T([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))


@pytest.mark.parametrize("buffer", [0, 21])
def test_overlong_penalty_rejects_bad_buffer(buffer):
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_reward_penalty(T([5]), 20, buffer)
