"""The generative judge's verdicts on each iteration's training rollouts (reward.judge, LLM-as-judge)."""

import dagster as dg

from assets.common import (
    ROLLOUT,
    asset_deps,
    data_version,
    iteration_of,
    lineage,
    outside_dag,
    run_iterations,
    timed,
    upstream_partition,
)
from assets.resources import RayResource, RolloutStoreResource, RunConfigResource
from stages.io.checkpoints import model_version
from stages.io.tables import PROMPTS_ITERATION
from stages.judgements import judge_rollouts
from stages.workers.shard_io import Sink
from stages.workers.sharded import commit_shards


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
    source = upstream_partition(context, rollout_store, "rollouts", cfg.run_id, it)
    prompts = upstream_partition(context, rollout_store, "prompts", cfg.run_id, PROMPTS_ITERATION)
    ray.ensure()
    sink = Sink(rollout_store.uri("judgements"), "judgements", cfg.run_id, it)
    with timed() as t:
        results = judge_rollouts(cfg, source, prompts, it, sink=sink)  # the judge ranks read and write the rows
    meta = lineage(cfg, stage="judgements", policy_version=it, upstream={"rollouts": source.version}, duration_s=t["s"])
    v = commit_shards(sink, results, meta)
    parts = [r.summary for r in results]
    parsed = sum(p["score_n"] for p in parts)
    sample = next((p["sample"] for p in parts if p["sample"] is not None), None)
    return dg.MaterializeResult(
        metadata={
            "delta_version": v,
            "rollouts": sum(p["rows"] for p in parts),
            "judge_unparsed": sum(p["unparsed"] for p in parts),
            "judge_score_mean": sum(p["score_sum"] for p in parts) / parsed if parsed else float("nan"),
            "judge_model": model_version(cfg.reward.judge.model_path),
            "sample_verdict": dg.MetadataValue.md(f"```\n{sample[:500]}\n```") if sample is not None else "",
            "judge_s": t["s"],
        },
        data_version=data_version("judgements", v),
    )
