"""On-policy distillation: per-token advantages from a teacher's log-probs of the student's own samples.

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

The formula is tinker-cookbook's on-policy distillation (thinking-machines-lab/tinker-cookbook,
tinker_cookbook/distillation/train_on_policy.py `incorporate_kl_penalty`, https://thinkingmachines.ai/blog/on-policy-distillation)
and verl's distillation loss with `use_policy_gradient=True, loss_mode="k1"` (verl/trainer/distillation/losses.py
`distillation_loss`: the policy-gradient loss with advantages = -k1 loss, clamped to +-loss_max_clamp):

    rkl_t = log pi_student(y_t | x, y_<t) - log pi_teacher(y_t | x, y_<t)     (k1: one-sample reverse KL at t)
    A_t   = [A_task_t if use_task_rewards] - kl_penalty_coef * clamp(rkl_t, -c, c) * mask_t

on the tokens y_t the student sampled, with no discount (tinker's kl_discount_factor = 0: a token is not
charged for the teacher's disagreement with later tokens). The update's usual clipped policy-gradient loss on
A_t then minimises the reverse KL(pi_student || pi_teacher) per token: mode-seeking, dense (one signal per token
instead of one per rollout), and on-policy (the states are the student's own).
"""

from __future__ import annotations

import torch
from torch import Tensor


def compute_distillation_advantages(
    task_advantages: Tensor,
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    response_mask: Tensor,
    *,
    kl_penalty_coef: float = 1.0,
    use_task_rewards: bool = True,
    loss_max_clamp: float | None = 10.0,
) -> tuple[Tensor, Tensor]:
    """Per-token on-policy distillation advantages (tinker-cookbook; verl use_policy_gradient with k1).

    Args:
        task_advantages: (N, L) the estimator's advantages of the task reward (ignored without use_task_rewards).
        logprobs: (N, L) the student's log-probs of its sampled tokens (the policy that sampled them).
        teacher_logprobs: (N, L) the teacher's log-probs of the same tokens, at the same temperature.
        response_mask: (N, L) 1 on the student's own tokens (0: padding, tool observations).
        kl_penalty_coef: weight of the distillation term (tinker's kl_penalty_coef).
        use_task_rewards: keep the task advantages (mixed); False: distillation alone (verl's name).
        loss_max_clamp: |rkl_t| is clamped to it before it enters A_t (verl's default 10); None: no clamp.
    Returns:
        ((N, L) advantages, (N, L) masked reverse-KL estimate rkl_t, unclamped, for metrics and the table).
    """
    assert logprobs.shape == teacher_logprobs.shape == response_mask.shape == task_advantages.shape, (
        f"{logprobs.shape=} {teacher_logprobs.shape=} {response_mask.shape=} {task_advantages.shape=}"
    )
    reverse_kl = (logprobs - teacher_logprobs) * response_mask  # (N, L)
    clamped = reverse_kl if loss_max_clamp is None else reverse_kl.clamp(-loss_max_clamp, loss_max_clamp)
    distill = -kl_penalty_coef * clamped * response_mask  # (N, L)
    base = task_advantages if use_task_rewards else torch.zeros_like(task_advantages)
    return base * response_mask + distill, reverse_kl


def teacher_kl_per_rollout(reverse_kl: Tensor, response_mask: Tensor) -> Tensor:
    """(N,) token-mean reverse KL of each rollout (0 for a rollout with no counted token).

    Args:
        reverse_kl: (N, L) masked rkl_t from compute_distillation_advantages.
        response_mask: (N, L).
    """
    return (reverse_kl * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)
