"""The `critic` section: the value model of PPO with GAE."""

from __future__ import annotations

from typing import Literal

from configs.sections.actor import OptimConfig
from configs.sections.base import _Strict


class CriticConfig(_Strict):
    """The value model of PPO with GAE (algorithm.adv_estimator='gae'); ignored by other estimators.

    Initialised from policy version 0 (backbone) plus a new scalar head, updated each iteration with
    the clipped value loss; verl's critic.* names."""

    optim: OptimConfig = OptimConfig(lr=1e-5)
    """Critic optimizer (verl critic.optim.lr defaults to 1e-5); grad_clip is critic.optim.grad_clip."""
    ppo_mini_batch_size: int = 32
    """Prompts per critic optimizer step (multiplied by rollout.n for rollouts), as actor's."""
    ppo_micro_batch_size: int = 64
    """Rollouts per critic forward/backward (gradient accumulation inside a mini-batch)."""
    ppo_epochs: int = 1
    """Passes of the critic over the iteration's batch."""
    cliprange_value: float = 0.5
    """Largest move of a value prediction away from its rollout-time value (value clipping)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How the per-token value loss is aggregated over the mini-batch (as actor.loss_agg_mode)."""
    loss_scale_factor: int | None = None
    """seq-mean-token-sum-norm's constant length; None: data.max_response_length."""
