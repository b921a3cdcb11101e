"""On-policy distillation advantages (stages/algos/distill.py): hand-derived numbers and invariants."""

from __future__ import annotations

import math

import torch

from stages.algos.distill import compute_distillation_advantages, teacher_kl_per_rollout

T = torch.tensor
LN2 = math.log(2)


def test_distillation_alone_golden():
    # Rollout 0 (3 tokens): student log-probs [ln 1/2, ln 1/4, ln 1], teacher [ln 1/4, ln 1/4, ln 1/2]
    #   rkl = [ln2, 0, ln2]; coef 0.5 -> A = -0.5 * rkl = [-0.346574, 0, -0.346574]
    # Rollout 1 (2 tokens, then padding): student [ln 1/8, -30], teacher [ln 1/2, 0]
    #   rkl = [ln(1/8) - ln(1/2) = -2 ln2 = -1.386294, -30]; -30 clamped to -10 -> A = [0.693147, 5.0]; pad -> 0.
    # use_task_rewards=False: the task advantages (all 7.0) are dropped.
    student = T([[-LN2, -2 * LN2, 0.0], [-3 * LN2, -30.0, 0.0]])
    teacher = T([[-2 * LN2, -2 * LN2, -LN2], [-LN2, 0.0, -5.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, rkl = compute_distillation_advantages(
        torch.full((2, 3), 7.0), student, teacher, mask, kl_penalty_coef=0.5, use_task_rewards=False
    )
    torch.testing.assert_close(adv, T([[-0.346574, 0.0, -0.346574], [0.693147, 5.0, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rkl, T([[LN2, 0.0, LN2], [-2 * LN2, -30.0, 0.0]]), atol=1e-6, rtol=0)
    # token-mean per rollout: (ln2 + 0 + ln2) / 3 = 0.462098; (-1.386294 - 30) / 2 = -15.693147
    torch.testing.assert_close(teacher_kl_per_rollout(rkl, mask), T([0.462098, -15.693147]), atol=1e-6, rtol=0)


def test_distillation_mixed_with_task_advantages_golden():
    # GRPO-style task advantage +1 on every token of the one rollout; rkl = [ln2, -ln2], coef 1, no clamp:
    #   A = 1 - [ln2, -ln2] = [0.306853, 1.693147]; the masked observation token (mask 0) keeps 0.
    student = T([[-LN2, -LN2, -1.0]])
    teacher = T([[-2 * LN2, 0.0, -9.0]])
    adv, _ = compute_distillation_advantages(
        torch.ones(1, 3), student, teacher, T([[1.0, 1.0, 0.0]]), loss_max_clamp=None
    )
    torch.testing.assert_close(adv, T([[0.306853, 1.693147, 0.0]]), atol=1e-6, rtol=0)


def test_student_equal_to_teacher_leaves_the_task_advantages():
    lp = torch.randn(4, 5).clamp(max=0)
    task = torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    adv, rkl = compute_distillation_advantages(task, lp, lp.clone(), mask)
    torch.testing.assert_close(adv, task * mask)
    assert not rkl.any()
