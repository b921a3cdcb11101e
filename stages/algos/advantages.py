"""Advantage estimators (outcome and token-level) and the adv_estimator dispatcher.

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300): a rollout's advantage is its reward
minus the mean reward of its group, divided by the group's std (unbiased, as torch.std and verl)
plus eps. Dr.GRPO (Liu et al. 2025, https://arxiv.org/abs/2503.20783) drops the std division.

Every estimator also exists token-level behind one dispatcher, `compute_advantages(name, ...)`,
with verl's `algorithm.adv_estimator` names (ADV_ESTIMATORS): gae, grpo (Dr.GRPO is grpo with
norm_adv_by_std_in_grpo=False), rloo, opo, reinforce_plus_plus, reinforce_plus_plus_baseline,
remax. Outcome scores are the masked sum of token_level_rewards over the response.
Outputs are 0 wherever the mask is 0.

Groups of one rollout follow verl exactly: their baseline is 0 (group mean 0, std 1), so the
advantage is the raw score: score / (1 + eps) for grpo, the score itself for Dr.GRPO, rloo and opo,
and for reinforce_plus_plus_baseline the score enters the batch whitening as is. Such groups are
what a filtered batch (flagged rewards dropped, DAPO's filter) or an odd-sized batch leaves behind,
and a run must give them the numbers verl gives. (verl's rloo_vectorized alone gives them 0; the
`rloo` name here is verl's `rloo`.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from stages.algos.gae import compute_gae_advantages
from stages.algos.masking import masked_whiten


def group_mean_std(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-rollout mean, unbiased std and size of the rollout's group, in one pass.

    Args:
        values: (N,) float.
        group_ids: (N,) int64; rollouts of one prompt share an id (any integers).
    Returns:
        mean (N,), std (N,), count (N,); a group of size 1 gets mean 0 and std 1 (verl), so
        subtracting the mean and dividing by the std leaves its value unchanged.
    """
    assert values.shape == group_ids.shape, f"{values.shape=} {group_ids.shape=}"
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (N,) dense 0..K-1
    k = int(inverse.max()) + 1 if inverse.numel() else 0
    v = values.to(torch.float64)
    zeros = torch.zeros(k, dtype=torch.float64, device=v.device)  # (K,)
    count = zeros.index_add(0, inverse, torch.ones_like(v))  # (K,)
    total = zeros.index_add(0, inverse, v)  # (K,)
    mean = total / count  # (K,)
    sq = zeros.index_add(0, inverse, (v - mean[inverse]) ** 2)  # (K,)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.ones_like(sq))  # (K,)
    mean = torch.where(count > 1, mean, torch.zeros_like(mean))  # (K,) singleton: 0
    return (mean[inverse].to(values.dtype), var.sqrt()[inverse].to(values.dtype), count[inverse].to(values.dtype))


def compute_grpo_advantages(
    rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6, scale_by_std: bool = True
) -> Tensor:
    """Group-relative outcome advantage (GRPO; Dr.GRPO when scale_by_std=False).

    Args:
        rewards: (N,) scalar outcome reward per rollout.
        group_ids: (N,) int64, rollouts of one prompt share an id.
    Returns:
        (N,) advantages; a group of size 1 keeps its raw reward (mean 0, std 1, as verl):
        reward / (1 + eps) with scale_by_std, the reward itself without.
    """
    mean, std, _ = group_mean_std(rewards, group_ids)
    adv = rewards - mean
    if scale_by_std:
        adv = adv / (std + eps)
    return adv


def broadcast_to_tokens(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome advantage copied onto every response token.

    Args:
        advantages: (N,) per-rollout scalar.
        response_mask: (N, L) float {0,1}.
    Returns:
        (N, L) token advantages, 0 where the mask is 0.
    """
    return advantages[:, None] * response_mask  # (N, L)


def group_sum(values: Tensor, group_ids: Tensor) -> Tensor:
    """Sum of values over each rollout's group, per rollout.

    Args:
        values: (N,) float.
        group_ids: (N,) int64; rollouts of one prompt share an id.
    Returns:
        (N,) the group total, repeated for every member.
    """
    assert values.shape == group_ids.shape, f"{values.shape=} {group_ids.shape=}"
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (N,) dense 0..K-1
    k = int(inverse.max()) + 1 if inverse.numel() else 0
    v = values.to(torch.float64)
    total = torch.zeros(k, dtype=torch.float64, device=v.device).index_add_(0, inverse, v)  # (K,)
    return total[inverse].to(values.dtype)  # (N,)


def outcome_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place each rollout's outcome score on its last counted response token (verl convention).

    Args:
        scores: (N,) outcome reward per rollout.
        response_mask: (N, L) float {0,1}.
    Returns:
        (N, L) zeros except scores[i] at the last position where response_mask[i] is 1;
        a row with an empty mask stays all zero.
    """
    assert scores.shape == response_mask.shape[:1], f"{scores.shape=} {response_mask.shape=}"
    positions = torch.arange(1, response_mask.shape[-1] + 1, dtype=response_mask.dtype)  # (L,)
    last = (response_mask * positions).argmax(dim=-1, keepdim=True)  # (N, 1)
    placed = torch.where(response_mask.sum(dim=-1) > 0, scores, torch.zeros_like(scores))
    out = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    return out.scatter_(-1, last, placed[:, None])  # (N, L)


def compute_rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out: reward minus the mean reward of the other group members.

    Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740 (Kool et al. 2019 baseline):
    A_i = r_i - (sum_j r_j - r_i) / (n - 1) = (r_i - mean) * n / (n - 1).

    Args:
        rewards: (N,) outcome reward per rollout.
        group_ids: (N,) int64, rollouts of one prompt share an id.
    Returns:
        (N,) advantages; a group of size 1 keeps its raw reward (no other member, baseline 0; verl).
    """
    mean, _, count = group_mean_std(rewards, group_ids)  # singleton: mean 0, count 1
    return (rewards - mean) * count / (count - 1).clamp(min=1.0)


def compute_opo_advantages(rewards: Tensor, response_lengths: Tensor, group_ids: Tensor) -> Tensor:
    """On-Policy RL with Optimal reward baseline: a length-weighted group mean as the baseline.

    Hao et al. 2025, https://arxiv.org/abs/2505.23585: b = sum_j |y_j| r_j / sum_j |y_j|.

    Args:
        rewards: (N,) outcome reward per rollout.
        response_lengths: (N,) counted response tokens per rollout.
        group_ids: (N,) int64.
    Returns:
        (N,) r - b; a group of size 1 has b = 0 (verl), so it keeps its raw reward.
    """
    lengths = response_lengths.to(rewards.dtype)
    weighted = group_sum(lengths * rewards, group_ids)  # (N,)
    baseline = weighted / group_sum(lengths, group_ids).clamp(min=1.0)  # (N,)
    count = group_sum(torch.ones_like(rewards), group_ids)  # (N,)
    return rewards - torch.where(count > 1, baseline, torch.zeros_like(baseline))


def compute_reinforce_plus_plus_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over the whole batch.

    Hu 2025, https://arxiv.org/abs/2501.03262. Over the counted tokens only, G_t = r_t + gamma * G_{t'}
    with t' the next counted token: a token whose mask is 0 (padding after EOS, a multi-turn tool
    observation inside the response) is skipped, its reward ignored, and the running return carried
    across it undiscounted, so the outcome reward at the last model token reaches the model tokens
    before an observation (verl 1dda039 compute_reinforce_plus_plus_outcome_advantage).

    Args:
        token_level_rewards: (N, L).
        response_mask: (N, L) float {0,1}.
        gamma: discount, applied once per counted token.
    Returns:
        advantages (N, L) whitened, returns (N, L) unwhitened; both 0 where the mask is 0.
    """
    assert token_level_rewards.shape == response_mask.shape, f"{token_level_rewards.shape=} {response_mask.shape=}"
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)  # (N, L)
        running = torch.zeros_like(token_level_rewards[:, 0])  # (N,)
        for t in reversed(range(returns.shape[-1])):
            m = response_mask[:, t]  # (N,)
            step = token_level_rewards[:, t] + gamma * running  # (N,)
            returns[:, t] = step * m
            running = torch.where(m > 0, step, running)  # a masked token: carried unchanged
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def compute_reinforce_plus_plus_baseline_advantages(
    rewards: Tensor, group_ids: Tensor, response_mask: Tensor
) -> Tensor:
    """REINFORCE++-baseline: group-mean-subtracted outcome, broadcast, whitened over the batch.

    Hu 2025, https://arxiv.org/abs/2501.03262 (the "baseline" variant for reasoning tasks).

    Args:
        rewards: (N,) outcome reward per rollout.
        group_ids: (N,) int64.
        response_mask: (N, L) float {0,1}.
    Returns:
        (N, L) advantages, 0 where the mask is 0; a group of size 1 enters the whitening with its
        raw reward (group mean 0, as verl).
    """
    mean, _, _ = group_mean_std(rewards, group_ids)
    centered = rewards - mean  # (N,)
    tokens = broadcast_to_tokens(centered, response_mask)  # (N, L)
    return masked_whiten(tokens, response_mask) * response_mask


def compute_remax_advantages(
    token_level_rewards: Tensor, baseline_rewards: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax: return-to-go minus the reward of the greedy response to the same prompt.

    Li et al. 2023, https://arxiv.org/abs/2310.10505.

    Args:
        token_level_rewards: (N, L).
        baseline_rewards: (N,) outcome reward of the greedy (argmax) rollout of each prompt.
        response_mask: (N, L) float {0,1}.
    Returns:
        advantages (N, L), returns (N, L) undiscounted return-to-go; 0 where the mask is 0.
    """
    assert baseline_rewards.shape == response_mask.shape[:1], f"{baseline_rewards.shape=} {response_mask.shape=}"
    masked = token_level_rewards * response_mask  # (N, L)
    returns = masked.flip(-1).cumsum(-1).flip(-1) * response_mask  # (N, L)
    return returns - baseline_rewards[:, None] * response_mask, returns


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an estimator may read; see compute_advantages for the shapes."""

    name: str
    token_level_rewards: Tensor
    response_mask: Tensor
    group_ids: Tensor | None
    values: Tensor | None
    baseline_rewards: Tensor | None
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    eps: float

    def need(self, field: str, why: str) -> Tensor:
        """The named optional tensor, or a ValueError saying who needs it and why."""
        value = getattr(self, field)
        if value is None:
            raise ValueError(
                f"adv_estimator '{self.name}' needs {field}, because {why}; pass {field}=... to compute_advantages."
            )
        return value

    def scores(self) -> Tensor:
        """(N,) outcome score: the masked sum of token_level_rewards."""
        return (self.token_level_rewards * self.response_mask).sum(dim=-1)


_GROUPS = "the baseline is computed within the rollouts of one prompt (group_ids (N,))"


def _gae(a: AdvantageInputs) -> tuple[Tensor, Tensor]:
    values = a.need("values", "GAE bootstraps from the critic's values (N, L)")
    return compute_gae_advantages(a.token_level_rewards, values, a.response_mask, a.gamma, a.lam)


def _grpo(a: AdvantageInputs) -> tuple[Tensor, Tensor]:
    adv = compute_grpo_advantages(
        a.scores(), a.need("group_ids", _GROUPS), eps=a.eps, scale_by_std=a.norm_adv_by_std_in_grpo
    )
    tokens = broadcast_to_tokens(adv, a.response_mask)
    return tokens, tokens


def _rloo(a: AdvantageInputs) -> tuple[Tensor, Tensor]:
    tokens = broadcast_to_tokens(compute_rloo_advantages(a.scores(), a.need("group_ids", _GROUPS)), a.response_mask)
    return tokens, tokens


def _opo(a: AdvantageInputs) -> tuple[Tensor, Tensor]:
    adv = compute_opo_advantages(a.scores(), a.response_mask.sum(dim=-1), a.need("group_ids", _GROUPS))
    tokens = broadcast_to_tokens(adv, a.response_mask)
    return tokens, tokens


def _reinforce_pp(a: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return compute_reinforce_plus_plus_advantages(a.token_level_rewards, a.response_mask, a.gamma)


def _reinforce_pp_baseline(a: AdvantageInputs) -> tuple[Tensor, Tensor]:
    tokens = compute_reinforce_plus_plus_baseline_advantages(a.scores(), a.need("group_ids", _GROUPS), a.response_mask)
    return tokens, tokens


def _remax(a: AdvantageInputs) -> tuple[Tensor, Tensor]:
    baseline = a.need("baseline_rewards", "ReMax subtracts the greedy rollout's reward (N,)")
    return compute_remax_advantages(a.token_level_rewards, baseline, a.response_mask)


ADV_ESTIMATORS: dict[str, Callable[[AdvantageInputs], tuple[Tensor, Tensor]]] = {
    "gae": _gae,
    "grpo": _grpo,
    "rloo": _rloo,
    "opo": _opo,
    "reinforce_plus_plus": _reinforce_pp,
    "reinforce_plus_plus_baseline": _reinforce_pp_baseline,
    "remax": _remax,
}


def compute_advantages(
    name: str,
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Token-level advantages and returns by verl estimator name (`algorithm.adv_estimator`).

    Args:
        name: one of ADV_ESTIMATORS.
        token_level_rewards: (N, L) rewards per token (an outcome score sits on the last
            counted token, see outcome_to_token_rewards; KL-in-reward already subtracted).
        response_mask: (N, L) float {0,1}.
        group_ids: (N,) int64 prompt ids; needed by grpo, rloo, opo, reinforce_plus_plus_baseline.
        values: (N, L) critic values; needed by gae.
        baseline_rewards: (N,) greedy-rollout rewards; needed by remax.
        gamma, lam: discount and GAE lambda (gae; gamma also reinforce_plus_plus).
        norm_adv_by_std_in_grpo: False gives Dr.GRPO (no division by the group std).
        eps: added to the group std (grpo).
    Returns:
        advantages (N, L), returns (N, L); 0 where the mask is 0. Outcome estimators return the
        advantages as returns (verl), except reinforce_plus_plus and remax (return-to-go).
    """
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"Unknown adv_estimator '{name}'. Valid: {sorted(ADV_ESTIMATORS)}")
    assert token_level_rewards.shape == response_mask.shape, f"{token_level_rewards.shape=} {response_mask.shape=}"
    inputs = AdvantageInputs(
        name,
        token_level_rewards,
        response_mask,
        group_ids,
        values,
        baseline_rewards,
        gamma,
        lam,
        norm_adv_by_std_in_grpo,
        eps,
    )
    with torch.no_grad():
        return ADV_ESTIMATORS[name](inputs)
