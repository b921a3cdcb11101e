"""Generalized Advantage Estimation over response tokens (PPO with a critic).

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

Choices (verl's `compute_gae_advantage_return`):
- The recursion runs right to left over the tokens whose mask is 1; a token with mask 0 (padding
  after EOS, or a tool/observation token inside a multi-turn response) is skipped: its value,
  reward and TD error are ignored and the bootstrap passes through it to the next counted token.
  The value after the last counted token is 0 (the episode ends).
- returns = advantages + values, taken before whitening.
- advantages are whitened over all counted tokens of the batch (verl `masked_whiten`).
- Deviation: both outputs are 0 where the mask is 0 (verl leaves carried values there), so the
  outputs do not depend on anything at masked positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stages.algos.masking import masked_whiten


def compute_gae_advantages(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    *,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """GAE(gamma, lambda) advantages and lambda-returns per token.

    Schulman et al. 2016, https://arxiv.org/abs/1506.02438:
    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},  R_t = A_t + V_t.

    Args:
        token_level_rewards: (N, L) reward per response token (outcome reward on the last token,
            minus the KL penalty when use_kl_in_reward).
        values: (N, L) critic value of the state before each response token.
        response_mask: (N, L) float {0,1}.
        gamma: discount.
        lam: GAE lambda (1.0 gives Monte-Carlo returns minus values).
        whiten: standardize the advantages over the counted tokens (verl always does).
    Returns:
        advantages (N, L), returns (N, L); both 0 where the mask is 0.
    """
    assert token_level_rewards.shape == values.shape == response_mask.shape, (
        f"{token_level_rewards.shape=} {values.shape=} {response_mask.shape=}"
    )
    with torch.no_grad():
        counted = response_mask > 0  # (N, L) bool
        zero = torch.zeros_like(token_level_rewards[:, 0])  # (N,)
        next_value, last_gae = zero, zero
        advantages = torch.zeros_like(token_level_rewards)  # (N, L)
        for t in reversed(range(token_level_rewards.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]  # (N,)
            gae_t = delta + gamma * lam * last_gae
            next_value = torch.where(counted[:, t], values[:, t], next_value)
            last_gae = torch.where(counted[:, t], gae_t, last_gae)
            advantages[:, t] = last_gae
        returns = torch.where(counted, advantages + values, torch.zeros_like(values))  # (N, L)
        advantages = torch.where(counted, advantages, torch.zeros_like(advantages))
        if whiten:
            advantages = masked_whiten(advantages, response_mask) * response_mask
    return advantages, returns
