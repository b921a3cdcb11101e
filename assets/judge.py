"""The generative judge's verdicts on each iteration's training rollouts (reward.judge, LLM-as-judge)."""

import dagster as dg
import numpy as np

from assets.common import (
    ROLLOUT,
    asset_deps,
    data_version,
    iteration_of,
    outside_dag,
    read_recorded,
    run_iterations,
    timed,
    write_table,
)
from assets.resources import RayResource, RolloutStoreResource, RunConfigResource
from stages.io.tables import PROMPTS_ITERATION
from stages.judge import judge_rollouts


@dg.asset(partitions_def=run_iterations, group_name=ROLLOUT, kinds={"ray", "delta"}, deps=asset_deps("judgements"))
def judgements(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    ray: RayResource,
) -> dg.MaterializeResult:
    """The judge's prompt, raw verdict and parsed score per rollout; unparsed verdicts are flagged rows."""
    cfg, it = run_config.load(), iteration_of(context)
    if skipped := outside_dag(cfg, "judgements"):
        return skipped
    df, version = read_recorded(context, rollout_store, "rollouts", cfg.run_id, it)
    prompts, _ = rollout_store.read("prompts", cfg.run_id, PROMPTS_ITERATION, columns=["prompt_id", "prompt"])
    ray.ensure()
    with timed() as t:
        out = judge_rollouts(cfg, df, prompts, it).assign(policy_version=it)
    v = write_table(
        rollout_store, cfg, "judgements", out, it, policy_version=it, upstream={"rollouts": version}, duration_s=t["s"]
    )
    scores = out["judge_score"].to_numpy(dtype=np.float64)
    return dg.MaterializeResult(
        metadata={
            "delta_version": v,
            "rollouts": len(out),
            "judge_unparsed": int(np.isnan(scores).sum()),
            "judge_score_mean": float(np.nanmean(scores)) if np.isfinite(scores).any() else float("nan"),
            "judge_model": str(out["judge_model"].iloc[0]) if len(out) else "",
            "sample_verdict": dg.MetadataValue.md(f"```\n{out['judge_output'].iloc[0][:500]}\n```") if len(out) else "",
            "judge_s": t["s"],
        },
        data_version=data_version("judgements", v),
    )
