"""The `algorithm` section: advantage estimator, KL in reward, DAPO filtering, rollout correction,
distillation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from configs.sections.base import _Strict

GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline")


class KLControlConfig(_Strict):
    """The KL-in-reward coefficient beta (verl's algorithm.kl_ctrl; stages/algos/kl_ctrl.py)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: constant kl_coef; adaptive: beta steered towards target_kl (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """(Initial) beta."""
    target_kl: float = 0.1
    """adaptive: the KL per token the controller steers to."""
    horizon: int = 10000
    """adaptive: rollouts over which the controller's proportional error acts."""


class FilterGroupsConfig(_Strict):
    """DAPO dynamic sampling (verl's algorithm.filter_groups): drop groups whose rollouts all got the
    same value of `metric` and generate more prompts until train_batch_size groups are kept."""

    enable: bool = False
    metric: Literal["acc", "score", "seq_reward"] = "acc"
    """acc: correct (task score >= reward.score) or not; score: the task score; seq_reward: the shaped
    reward (score + overlong penalty; the KL-in-reward term is not included)."""
    max_num_gen_batches: int = 0
    """Generation rounds per iteration at most; 0 = until the training prompts are exhausted."""


ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""verl's rejection-sampling statistics: level (token, or the sequence's sum / mean / max) of a KL estimator of
log r = old_logprobs - rollout_logprobs (k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r)."""


def _bounds(spec: str | float, what: str, *, ratio: bool) -> tuple[float | None, float]:
    """(lower, upper) of one threshold spec: a number (upper; lower = 1 / upper when `ratio`) or, when `ratio`,
    a 'lower_upper' string (verl); both > 0 and lower <= upper, else a what/why/fix ValueError."""
    text = str(spec).strip()
    parts = text.split("_", 1) if "_" in text else [None, text]
    if parts[0] is not None and not ratio:
        raise ValueError(f"{what} '{spec}' must be one upper bound: a 'lower_upper' pair is for ratio (k1) bounds")
    try:
        lower, upper = (None if p is None else float(p) for p in parts)
    except ValueError:
        raise ValueError(f"{what} '{spec}' is not a number or a 'lower_upper' pair such as '0.5_2.0'") from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"{what} '{spec}' must be > 0: the bounds are probability ratios or divergences")
    if ratio and lower is None and upper < 1.0:
        raise ValueError(
            f"{what} '{spec}' must be >= 1: a single number is the upper ratio bound and 1 / it the lower one; "
            "give both as 'lower_upper' for other bounds"
        )
    if ratio and lower is None:
        lower = 1.0 / upper
    if lower is not None and lower > upper:
        raise ValueError(f"{what} '{spec}': lower bound {lower} > upper bound {upper}; swap them ('lower_upper')")
    return lower, upper


class RolloutCorrectionConfig(_Strict):
    """Correction of the gap between the rollout engine's sampling probabilities and the trainer's (verl's
    algorithm.rollout_correction, decoupled mode; stages/algos/rollout_is.py). r = exp(old_logprobs -
    rollout_logprobs) per token. Off by default (rollout_is and rollout_rs null). Quote 'lower_upper' strings in
    YAML and overrides: YAML reads an unquoted 0.5_2 as the number 0.52."""

    rollout_is: Literal["token", "sequence"] | None = None
    """Importance weights multiplying the per-token policy loss: token = r_t, sequence = prod_t r_t; null = none."""
    rollout_is_threshold: float | str = 2.0
    """A number: truncate the weights at it (TIS); a 'lower_upper' string such as '0.5_5.0': zero the weights
    outside [lower, upper] (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their batch mean (token mean, or mean over non-empty rollouts for sequence)."""
    rollout_rs: str | None = None
    """Rejection sampling: comma-separated ROLLOUT_RS_OPTIONS (e.g. 'token_k1,seq_max_k2'); a token or rollout
    outside its threshold leaves the loss (its response_mask set to 0); null = none."""
    rollout_rs_threshold: float | str | None = None
    """One threshold per rollout_rs option, comma-separated (one is shared by all): k1 options take ratio bounds
    ('lower_upper', or a number = upper with lower = 1 / upper), k2 / k3 options an upper bound."""

    @property
    def enabled(self) -> bool:
        """Whether the update needs the engine's rollout_logprobs (either correction is on)."""
        return self.rollout_is is not None or self.rollout_rs is not None

    def is_bounds(self) -> tuple[float | None, float]:
        """(lower, upper) of the importance weights: lower None = truncate at upper (TIS), else IcePop."""
        text = str(self.rollout_is_threshold)
        return _bounds(text, "algorithm.rollout_correction.rollout_is_threshold", ratio="_" in text)

    def rs_bounds(self) -> dict[str, tuple[float | None, float]]:
        """{option: (lower, upper)} of rollout_rs in its order (duplicates dropped); empty when it is null."""
        if self.rollout_rs is None:
            return {}
        options = list(dict.fromkeys(o.strip() for o in self.rollout_rs.split(",") if o.strip()))
        specs = [s.strip() for s in str(self.rollout_rs_threshold).split(",") if s.strip()]
        specs = specs * len(options) if len(specs) == 1 else specs
        what = "algorithm.rollout_correction.rollout_rs_threshold"
        return {o: _bounds(s, f"{what} of {o}", ratio=o.endswith("k1")) for o, s in zip(options, specs, strict=True)}

    @model_validator(mode="before")
    @classmethod
    def _no_bool_threshold(cls, data: Any) -> Any:
        bad = [
            k
            for k in ("rollout_is_threshold", "rollout_rs_threshold")
            if isinstance(data, dict) and isinstance(data.get(k), bool)
        ]
        if bad:
            raise ValueError(
                f"algorithm.rollout_correction.{bad[0]} must be a number or a string such as '0.5_2.0', not a boolean"
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> RolloutCorrectionConfig:
        self.is_bounds()
        if self.rollout_rs is None:
            return self
        options = [o.strip() for o in self.rollout_rs.split(",") if o.strip()]
        bad = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
        if not options or bad:
            raise ValueError(
                f"algorithm.rollout_correction.rollout_rs '{self.rollout_rs}' has unknown options {bad}; "
                f"valid (comma-separated): {list(ROLLOUT_RS_OPTIONS)}"
            )
        n_specs = len([s for s in str(self.rollout_rs_threshold).split(",") if s.strip()])
        if self.rollout_rs_threshold is None or n_specs not in (1, len(dict.fromkeys(options))):
            raise ValueError(
                f"algorithm.rollout_correction.rollout_rs '{self.rollout_rs}' needs rollout_rs_threshold: one "
                f"threshold for all its options or one per option (comma-separated), got {self.rollout_rs_threshold!r}"
            )
        self.rs_bounds()
        return self


class DistillationConfig(_Strict):
    """On-policy distillation (docs/algorithms.md): a teacher on its own "teacher" worker group scores every
    rollout's sampled tokens (the teacher_logprobs table), and each token's advantage gains
    -kl_penalty_coef * (log pi_student - log pi_teacher), tinker-cookbook's on-policy distillation and verl's
    distillation with use_policy_gradient and loss_mode k1 (stages/algos/distill.py)."""

    enable: bool = False
    """Run the teacher_logprobs stage and add the per-token reverse-KL advantage."""
    teacher_model_path: str | None = None
    """Local HF checkpoint directory of the teacher (config.json + tokenizer), e.g. another run's
    checkpoints/<run>/policy_v<N>; it must use the student's tokenizer (same vocabulary). Required with enable."""
    kl_penalty_coef: float = 1.0
    """Weight of the distillation advantage (tinker-cookbook's kl_penalty_coef)."""
    use_task_rewards: bool = True
    """true: the task reward's advantages plus the distillation term (mixed); false: distillation alone (verl)."""
    loss_max_clamp: float | None = 10.0
    """|log pi_student - log pi_teacher| is clamped to it per token (verl's default 10); null: no clamp."""
    num_workers: int = 1
    """Teacher workers (RefWorkers of the "teacher" group, placed as the reference model's)."""

    @model_validator(mode="after")
    def _check(self) -> DistillationConfig:
        if self.enable and not self.teacher_model_path:
            raise ValueError(
                "algorithm.distillation.enable=true needs algorithm.distillation.teacher_model_path, because the "
                "teacher is loaded from a local checkpoint directory; set teacher_model_path=<dir with config.json> "
                "(e.g. a finished run's checkpoints/<run>/policy_v<N>) or algorithm.distillation.enable=false."
            )
        if self.enable and (self.kl_penalty_coef <= 0 or self.num_workers < 1):
            raise ValueError(
                f"algorithm.distillation.kl_penalty_coef ({self.kl_penalty_coef}) must be > 0 and num_workers "
                f"({self.num_workers}) >= 1, because the teacher's signal is the advantage times the coefficient; "
                "raise them, or set algorithm.distillation.enable=false."
            )
        if self.loss_max_clamp is not None and self.loss_max_clamp <= 0:
            raise ValueError(
                f"algorithm.distillation.loss_max_clamp ({self.loss_max_clamp}) must be > 0 or null, because it "
                "bounds |log-ratio| per token; use verl's 10.0 or null for no clamp."
            )
        return self


class AlgorithmConfig(_Strict):
    adv_estimator: Literal[
        "grpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae", "remax"
    ] = "grpo"
    """verl's estimator names (stages/algos/advantages.py); gae is PPO with a critic (the `critic`
    section); remax also generates one greedy response per prompt (stored as is_baseline rollouts) whose
    reward is the baseline, so any rollout.n >= 1 works and norm_adv_by_std_in_grpo is ignored."""
    norm_adv_by_std_in_grpo: bool = True
    """False gives Dr.GRPO's unscaled advantage."""
    gamma: float = 1.0
    """Discount of token-level returns (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda (gae): 1.0 gives Monte-Carlo returns minus values, 0.0 one-step TD errors."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL(rollout policy || reference policy) from every token's reward (verl);
    runs the ref_logprobs stage."""
    kl_penalty: Literal[
        "kl",
        "k1",
        "abs",
        "mse",
        "k2",
        "low_var_kl",
        "k3",
        "full",
        "kl+",
        "k1+",
        "abs+",
        "mse+",
        "k2+",
        "low_var_kl+",
        "k3+",
    ] = "kl"
    """KL estimator of the in-reward penalty (stages/algos/kl.py); 'full' is not supported (rollouts
    store only the sampled token's log-prob)."""
    kl_ctrl: KLControlConfig = KLControlConfig()
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Engine-vs-trainer importance weights and rejection sampling in the policy loss (verl's names)."""
    distillation: DistillationConfig = DistillationConfig()
    """On-policy distillation from a teacher model, alone or mixed with the task reward."""
