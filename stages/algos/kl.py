"""KL penalty estimators between the policy and a reference policy, per token.

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

Estimators follow Schulman's note (http://joschu.net/blog/kl-approx.html) and verl's names:
k1 / kl = log r, abs = |log r|, k2 / mse = 0.5 (log r)^2, k3 / low_var_kl = exp(-log r) - 1 + log r
clamped to [-10, 10] (log r first clamped to [-20, 20], as verl, so exp cannot overflow into a NaN
gradient), with log r = logprobs - ref_logprobs; full = the exact KL(pi || pi_ref) from full
(N, L, V) log-distributions.

Straight-through variants (verl `kl_penalty`, which strips one trailing "+"): every sampled-token
name above with a "+" appended (k1+, kl+, abs+, k2+, mse+, k3+, low_var_kl+) has the value of the
named estimator and the gradient of k2, whose expected gradient is the true KL's (k1's and k3's
are not): k2 - k2.detach() + named.detach(). k2+ / mse+ are accepted, as in verl, and equal k2.
There is no full+ (k2 needs the sampled token's log-ratio; verl has no full estimator at all).
Under no_grad, as in apply_kl_penalty, a "+" name gives exactly the named estimator's value.

The KL is used either as a loss term (actor.use_kl_loss, masked mean of compute_kl_penalty) or in
the reward (algorithm.use_kl_in_reward, apply_kl_penalty before the advantage estimator).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stages.algos.masking import masked_mean

_SAMPLED = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_ESTIMATORS = (*_SAMPLED, "full", *(f"{name}+" for name in _SAMPLED))


def compute_kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate.

    Args:
        logprobs: (N, L) log-probs of the sampled tokens under the current policy;
            for kind="full", (N, L, V) log-softmax over the vocabulary.
        ref_logprobs: (N, L) the same under the reference policy; (N, L, V) for "full".
        kind: one of KL_ESTIMATORS; a name ending in "+" is straight-through (value of the
            named estimator, gradient of k2).
    Returns:
        (N, L) estimate (not masked).
    """
    assert logprobs.shape == ref_logprobs.shape, f"{logprobs.shape=} {ref_logprobs.shape=}"
    if kind == "full":
        assert logprobs.dim() == 3, f"kind='full' needs (N, L, V) log-probs, got {logprobs.shape=}"
        return (logprobs.exp() * (logprobs - ref_logprobs)).sum(dim=-1)  # (N, L)
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"Unknown KL estimator '{kind}'. Valid: {list(KL_ESTIMATORS)}")
    log_ratio = logprobs - ref_logprobs  # (N, L)
    value = _sampled_kl(log_ratio, kind.removesuffix("+"))  # (N, L)
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * log_ratio.square()  # (N, L) carries the gradient
    return k2 - k2.detach() + value.detach()


def _sampled_kl(log_ratio: Tensor, kind: str) -> Tensor:
    """(N, L) estimator `kind` (a sampled-token name without "+") of a (N, L) log-ratio."""
    if kind in ("k1", "kl"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    x = log_ratio.clamp(min=-20.0, max=20.0)  # k3 / low_var_kl
    return (torch.exp(-x) - 1.0 + x).clamp(min=-10.0, max=10.0)


def apply_kl_penalty(
    token_level_scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[Tensor, dict[str, float]]:
    """KL in the reward: r_t = score_t - beta * KL_t on counted tokens (verl `apply_kl_penalty`).

    Ziegler et al. 2019, https://arxiv.org/abs/1909.08593 (per-token KL-shaped reward).

    Args:
        token_level_scores: (N, L) task reward per token (outcome on the last counted token).
        logprobs: (N, L) rollout-policy log-probs of the sampled tokens (verl: old_log_prob).
        ref_logprobs: (N, L) reference-policy log-probs.
        response_mask: (N, L) float {0,1}.
        kl_coef: beta, the controller's current value.
        kind: one of KL_ESTIMATORS except "full" (verl's default here is k1 / "kl"); a "+" name
            gives the named estimator's value (no gradient flows here).
    Returns:
        (token_level_rewards (N, L), metrics) with actor/reward_kl_penalty (mean over rollouts
        of the per-rollout token-mean KL; feed it to the KL controller's update) and
        actor/reward_kl_penalty_coeff.
    """
    with torch.no_grad():
        kld = compute_kl_penalty(logprobs, ref_logprobs, kind) * response_mask  # (N, L)
        rewards = token_level_scores - kl_coef * kld
        current_kl = masked_mean(kld, response_mask, dim=-1).mean()  # per rollout, then mean
    metrics = {"actor/reward_kl_penalty": float(current_kl), "actor/reward_kl_penalty_coeff": float(kl_coef)}
    return rewards, metrics
