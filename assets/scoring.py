"""Per-iteration scoring assets: rewards and advantages."""

import dagster as dg
import numpy as np

from assets.common import ROLLOUT, TRAIN, iterations, lineage, timed
from assets.resources import RayResource, RolloutStoreResource, RunConfigResource
from assets.rollout import rollouts
from stages.advantage import compute_advantage_table
from stages.reward import score_rollouts


@dg.asset(partitions_def=iterations, group_name=ROLLOUT, kinds={"ray", "delta"}, deps=[rollouts],
          check_specs=[dg.AssetCheckSpec("rewards_finite", asset="scored_rollouts", blocking=True)])
def scored_rollouts(context: dg.AssetExecutionContext, run_config: RunConfigResource,
                    rollout_store: RolloutStoreResource, ray: RayResource) -> dg.MaterializeResult:
    """Rollouts with rule-based rewards by data_source; re-materialize to re-score without regenerating."""
    cfg, it = run_config.load(), int(context.partition_key)
    df, version = rollout_store.read("rollouts", cfg.run_id, it)
    ray.ensure()
    with timed() as t:
        scored = score_rollouts(df, cfg.reward)
    v = rollout_store.write("scored_rollouts", scored, run_id=cfg.run_id, iteration=it,
                            lineage=lineage(cfg, stage="scored_rollouts", policy_version=it, upstream={"rollouts": version}, duration_s=t["s"]))
    bad = int((~np.isfinite(scored["reward"])).sum())
    return dg.MaterializeResult(
        metadata={"delta_version": v, "reward_mean": float(np.nanmean(scored["reward"])), "rollouts": len(scored),
                  "reward_fns": sorted(scored["reward_fn"].unique())},
        check_results=[dg.AssetCheckResult(check_name="rewards_finite", passed=bad == 0, metadata={"non_finite": bad})])


@dg.asset(partitions_def=iterations, group_name=TRAIN, kinds={"pytorch", "delta"}, deps=[scored_rollouts],
          check_specs=[dg.AssetCheckSpec("advantages_finite", asset="advantages", blocking=True)])
def advantages(context: dg.AssetExecutionContext, run_config: RunConfigResource,
               rollout_store: RolloutStoreResource) -> dg.MaterializeResult:
    """Per-rollout advantages (algorithm.adv_estimator), group statistics in one pass."""
    cfg, it = run_config.load(), int(context.partition_key)
    scored, version = rollout_store.read("scored_rollouts", cfg.run_id, it)
    with timed() as t:
        adv = compute_advantage_table(scored, cfg.algorithm)
    v = rollout_store.write("advantages", adv, run_id=cfg.run_id, iteration=it,
                            lineage=lineage(cfg, stage="advantages", policy_version=it, upstream={"scored_rollouts": version}, duration_s=t["s"]))
    finite = bool(np.isfinite(adv["advantage"]).all())
    return dg.MaterializeResult(
        metadata={"delta_version": v, "adv_estimator": cfg.algorithm.adv_estimator, "advantage_abs_mean": float(adv["advantage"].abs().mean()),
                  "zero_advantage_frac": float((adv["advantage"] == 0).mean())},
        check_results=[dg.AssetCheckResult(check_name="advantages_finite", passed=finite)])
