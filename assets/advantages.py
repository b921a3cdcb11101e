"""The advantages asset: per-rollout advantages, streamed (stages/advantages.py)."""

import dagster as dg
import numpy as np

from assets.stage_assets import StageRun
from stages.advantage_table import uses_adaptive_kl
from stages.advantages import Upstream
from stages.dag import uses_teacher
from stages.scored_tokens import ScoredRollouts


def materialize(run: StageRun) -> dg.MaterializeResult:
    """Per-rollout advantages (algorithm.adv_estimator), group statistics in one pass, streamed: the step holds
    scalar columns and dense tensors, never a whole table's token lists (stages/advantages.py)."""
    cfg, it, inputs = run.cfg, run.iteration, run.inputs
    previous = run.partition("advantages", it - 1) if uses_adaptive_kl(cfg) and it > 0 else None
    up = Upstream(
        scored=ScoredRollouts(inputs["scored_rollouts"], inputs["rollouts"]),  # the token columns: rollouts
        old=inputs["old_logprobs"],
        ref=inputs["ref_logprobs"],
        values=inputs["values"],
        teacher=inputs["teacher_logprobs"],
        previous=previous,  # adaptive KL: beta from it-1
    )
    tables = {**inputs, "advantages": previous}
    read_versions = {t: p.version for t, p in tables.items() if p is not None}
    done = run.compute(
        cfg,
        up,
        run.rollout_store.uri("advantages"),
        lineage=lambda: run.lineage(read_versions, policy_version=it),
    )
    if done.dropped:
        run.log.info(f"dropped {done.dropped} rollouts flagged by the reward stage (reward.on_error=flag)")
    return advantages_result(run, done)


def advantages_result(run: StageRun, done) -> dg.MaterializeResult:
    """The advantages asset's metadata and finite check, from the stage's per-row SUMMARY columns."""
    cfg, adv = run.cfg, done.summary
    finite = bool(np.isfinite(adv["advantage"]).all())
    return run.result(
        done.version,
        {
            "adv_estimator": cfg.algorithm.adv_estimator,
            "advantage_abs_mean": float(adv["advantage"].abs().mean()),
            "zero_advantage_frac": float((adv["advantage"] == 0).mean()),
            "kept_groups": int(adv["group_id"].nunique()),
            "kl_coef": float(adv["kl_coef"].iloc[0]) if cfg.algorithm.use_kl_in_reward else 0.0,
            "teacher_kl_mean": float(adv["teacher_kl"].mean()) if uses_teacher(cfg) else 0.0,
            "mode": done.mode,
        },
        [dg.AssetCheckResult(check_name="advantages_finite", passed=finite)],
    )
