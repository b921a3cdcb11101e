"""The critic_checkpoint asset: the critic update of PPO with GAE (stages/critic_checkpoint.py)."""

import dagster as dg

from assets.common import record_checkpoint
from assets.stage_assets import StageRun
from stages.io.checkpoints import checkpoint_target
from stages.train.critic import prune_critics, require_critic


def materialize(run: StageRun) -> dg.MaterializeResult:
    """Critic update (clipped value loss towards the GAE returns); commits critic version iteration+1 (retracting
    a committed one first: a re-materialization) and records it, with its metrics, in the `checkpoints` table."""
    cfg, it = run.cfg, run.iteration
    adv, vals = run.inputs["advantages"], run.inputs["values"]  # handles: the rank reads them
    ms = run.model_store.for_run(cfg.run_id)
    ms.retract(it + 1, "critic")
    critic_dir = require_critic(ms, it, seed=cfg.seed, needed_by=f"critic update of iteration {it}")
    metrics = run.compute(cfg, it, adv, vals, out_dir=checkpoint_target(ms, "critic", it + 1), critic_dir=critic_dir)
    manifest = ms.manifest(it + 1, "critic")
    upstream = {"advantages": adv.version, "values": vals.version}
    record_checkpoint(run.rollout_store, cfg, manifest, it, upstream=upstream, metrics=metrics)
    pruned = prune_critics(ms, cfg.trainer.save_freq, latest=it + 1)
    return run.checkpoint_result(
        "critic",
        it + 1,
        {
            **metrics,
            "critic_version": it + 1,
            "path": manifest["uri"],
            "checkpoint_id": manifest["checkpoint_id"],
            "pruned_versions": pruned,
            "advantages_version": int(adv.version),
            "values_version": int(vals.version),
        },
    )
