"""The values asset: the critic's per-token values of the rollouts (PPO with GAE; stages/values.py).

Critic version 0 is created lazily from policy version 0 by `values` of iteration 0 (no set-up asset), so a GRPO
run never builds one; critic version v scores iteration v, critic_checkpoint of iteration v writes v+1."""

import dagster as dg

from assets.common import record_checkpoint
from assets.stage_assets import StageRun
from stages.train.critic import require_critic


def materialize(run: StageRun) -> dg.MaterializeResult:
    """Per-token values of the rollouts' responses under critic version == iteration (GAE's baseline)."""
    cfg, it, source = run.cfg, run.iteration, run.inputs["rollouts"]
    ms = run.model_store.for_run(cfg.run_id)
    sink = run.sink()
    created = it == 0 and ms.manifest(0, "critic") is None
    critic_dir = require_critic(ms, it, seed=cfg.seed, needed_by=f"values of iteration {it}")
    if created:  # critic version 0, made from policy version 0 on first use
        record_checkpoint(run.rollout_store, cfg, ms.manifest(0, "critic"), it, upstream={})
    results = run.compute(cfg, source, critic_dir, it, sink)  # the critic rank reads and writes the rows
    v = run.commit(sink, results, run.lineage({"rollouts": source.version}, policy_version=it))
    n = sum(r.summary["n"] for r in results)
    bad = sum(r.summary["non_finite"] for r in results)  # a NaN value would turn every GAE advantage into NaN
    check = dg.AssetCheckResult(check_name="values_finite", passed=bad == 0, metadata={"non_finite": bad})
    return run.result(
        v,
        {
            "critic_version": it,
            "rollouts": sum(r.rows for r in results),
            "values_mean": sum(r.summary["sum"] for r in results) / n if n else 0.0,
            "checkpoint_id": ms.manifest(it, "critic")["checkpoint_id"] or "none",
        },
        [check],
    )
