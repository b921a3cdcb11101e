"""KL coefficient controllers for KL-in-reward (algorithm.kl_ctrl).

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

No tensors here: a controller holds beta (`value`) and updates it once per iteration from the
measured KL (actor/reward_kl_penalty of kl.apply_kl_penalty). `value` is plain state the
pipeline must checkpoint to resume exactly.
"""

from __future__ import annotations

KL_CONTROLLERS = ("fixed", "adaptive")


class FixedKLController:
    """Constant beta."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the signature matches AdaptiveKLController.update)."""


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards target_kl.

    Ziegler et al. 2019, https://arxiv.org/abs/1909.08593 (section 2.2), as in verl:
    e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target_kl > 0 and horizon > 0, got "
                f"target_kl={target_kl}, horizon={horizon}; verl uses 0.1 and 10000."
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale beta by the clipped proportional error.

        Args:
            current_kl: the KL measured this iteration (mean per-rollout token-mean KL).
            n_steps: rollouts in the iteration (verl passes the batch size).
        """
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(
    kind: str, *, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """The controller named by algorithm.kl_ctrl.type.

    Args:
        kind: one of KL_CONTROLLERS.
        kl_coef: (initial) beta.
        target_kl, horizon: adaptive only.
    """
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown KL controller '{kind}'. Valid: {list(KL_CONTROLLERS)}")
