"""PPO-with-GAE critic assets: the rollouts' per-token values and the critic update.

In the iteration job only when algorithm.adv_estimator == "gae" (stages/dag.py uses_critic). Critic version 0
is created lazily from policy version 0 by `values` of iteration 0 (no set-up asset), so a GRPO run
never builds one; critic version v scores iteration v, critic_checkpoint of iteration v writes v+1.
"""

import dagster as dg

from assets.common import (
    TRAIN,
    asset_deps,
    check_spec,
    checkpoint_version,
    data_version,
    iteration_of,
    lineage,
    outside_dag,
    record_checkpoint,
    run_iterations,
    timed,
    upstream_partition,
)
from assets.resources import ModelStoreResource, RolloutStoreResource, RunConfigResource
from stages.critic_checkpoint import train_critic
from stages.io.checkpoints import checkpoint_target
from stages.train.critic import prune_critics, require_critic
from stages.values import rollout_values
from stages.workers.shard_io import Sink
from stages.workers.sharded import commit_shards


@dg.asset(
    partitions_def=run_iterations,
    group_name=TRAIN,
    kinds={"pytorch", "delta"},
    deps=asset_deps("values"),
    check_specs=[check_spec("values_finite", asset="values", blocking=True)],
)
def values(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
) -> dg.MaterializeResult:
    """Per-token values of the rollouts' responses under critic version == iteration (GAE's baseline)."""
    cfg, it = run_config.load(), iteration_of(context)
    if skipped := outside_dag(cfg, "values", checks=("values_finite",)):
        return skipped
    source = upstream_partition(context, rollout_store, "rollouts", cfg.run_id, it)
    ms = model_store.for_run(cfg.run_id)
    sink = Sink(rollout_store.uri("values"), "values", cfg.run_id, it)
    with timed() as t:
        created = it == 0 and ms.manifest(0, "critic") is None
        critic_dir = require_critic(ms, it, seed=cfg.seed, needed_by=f"values of iteration {it}")
        if created:  # critic version 0, made from policy version 0 on first use
            record_checkpoint(rollout_store, cfg, ms.manifest(0, "critic"), it, upstream={})
        results = rollout_values(cfg, source, critic_dir, it, sink)  # the critic rank reads and writes the rows
    meta = lineage(cfg, stage="values", policy_version=it, upstream={"rollouts": source.version}, duration_s=t["s"])
    v = commit_shards(sink, results, meta)
    n = sum(r.summary["n"] for r in results)
    bad = sum(r.summary["non_finite"] for r in results)  # a NaN value would turn every GAE advantage into NaN
    return dg.MaterializeResult(
        metadata={
            "delta_version": v,
            "critic_version": it,
            "rollouts": sum(r.rows for r in results),
            "values_mean": sum(r.summary["sum"] for r in results) / n if n else 0.0,
            "checkpoint_id": ms.manifest(it, "critic")["checkpoint_id"] or "none",
        },
        data_version=data_version("values", v),
        check_results=[dg.AssetCheckResult(check_name="values_finite", passed=bad == 0, metadata={"non_finite": bad})],
    )


@dg.asset(partitions_def=run_iterations, group_name=TRAIN, kinds={"pytorch"}, deps=asset_deps("critic_checkpoint"))
def critic_checkpoint(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
) -> dg.MaterializeResult:
    """Critic update (clipped value loss towards the GAE returns); commits critic version iteration+1 (retracting
    a committed one first: a re-materialization) and records it, with its metrics, in the `checkpoints` table."""
    cfg, it = run_config.load(), iteration_of(context)
    if skipped := outside_dag(cfg, "critic_checkpoint"):
        return skipped
    adv = upstream_partition(context, rollout_store, "advantages", cfg.run_id, it)  # handles: the rank reads them
    vals = upstream_partition(context, rollout_store, "values", cfg.run_id, it)
    adv_version, values_version = adv.version, vals.version
    ms = model_store.for_run(cfg.run_id)
    ms.retract(it + 1, "critic")
    critic_dir = require_critic(ms, it, seed=cfg.seed, needed_by=f"critic update of iteration {it}")
    metrics = train_critic(cfg, it, adv, vals, out_dir=checkpoint_target(ms, "critic", it + 1), critic_dir=critic_dir)
    manifest = ms.manifest(it + 1, "critic")
    upstream = {"advantages": adv_version, "values": values_version}
    record_checkpoint(rollout_store, cfg, manifest, it, upstream=upstream, metrics=metrics)
    pruned = prune_critics(ms, cfg.trainer.save_freq, latest=it + 1)
    return dg.MaterializeResult(
        metadata={
            **metrics,
            "critic_version": it + 1,
            "path": manifest["uri"],
            "checkpoint_id": manifest["checkpoint_id"],
            "pruned_versions": pruned,
            "advantages_version": int(adv_version),
            "values_version": int(values_version),
        },
        data_version=checkpoint_version("critic", it + 1, context),
    )
