"""The old_logprobs asset: the actor's recomputed log-probs of the rollouts (verl's compute_log_prob ->
old_log_prob; stages/old_logprobs.py)."""

import dagster as dg

from assets.stage_assets import StageRun
from stages.old_logprobs import old_logprobs_gap


def materialize(run: StageRun) -> dg.MaterializeResult:
    """Per-token log-probs of every response under the policy being updated (version == iteration; with
    trainer.async_mode=one_step_off the rollouts were sampled by the version before it), on the actor workers,
    which keep that policy resident for the update; and their gap to the engine's."""
    cfg, it = run.cfg, run.iteration
    results, v, seconds = run.model_pass(it)
    gap = old_logprobs_gap(results)  # over every rollout (ReMax baselines too), merged from the ranks' moments
    rows = sum(r.rows for r in results)
    check = probs_gap_check(gap, cfg.trainer.max_rollout_probs_diff_mean, lag=it - cfg.trainer.rollout_version(it))
    return run.result(v, {"rollouts": rows, "policy_version": it, "old_s": seconds, **gap}, [check])


def probs_gap_check(gap: dict[str, float], limit: float | None, *, lag: int = 0) -> dg.AssetCheckResult:
    """Warn when the engine's sampling probabilities drift from the trainer's (verl's rollout_probs_diff);
    NaN (no response token counted) passes. lag > 0 (one_step_off: the rollouts were sampled by an older
    policy than the trainer holds): the gap then includes the updates in between by design, so it is recorded,
    not judged."""
    mean = float(gap.get("training/rollout_probs_diff_mean", float("nan")))
    meta = {
        "rollout_probs_diff_mean": mean,
        "rollout_probs_diff_max": float(gap.get("training/rollout_probs_diff_max", float("nan"))),
    }
    name = "rollout_probs_diff_within_limit"
    if lag > 0:
        why = f"not judged: the rollouts trail the trainer by {lag} update(s) (trainer.async_mode=one_step_off)"
        return dg.AssetCheckResult(
            check_name=name, passed=True, metadata={**meta, "limit": "off" if limit is None else limit, "skipped": why}
        )
    if limit is None:
        return dg.AssetCheckResult(check_name=name, passed=True, metadata={**meta, "limit": "off"})
    passed = not mean > limit
    why = (
        ""
        if passed
        else (
            f"the engine's sampling probabilities differ from the trainer's by {mean:.3g} on average "
            f"(> trainer.max_rollout_probs_diff_mean = {limit:g}): the PPO ratio's denominator no longer matches "
            "what generated the tokens. Check that the engine got this policy's weights (the "
            "engine_weights_match_policy check of rollouts), the engine's dtype against the actor's, and "
            "sampling settings the trainer does not apply; raise the limit if the gap is expected"
        )
    )
    return dg.AssetCheckResult(
        check_name=name,
        passed=passed,
        severity=dg.AssetCheckSeverity.WARN,
        description=why or None,
        metadata={**meta, "limit": limit, **({"message": why} if why else {})},
    )
