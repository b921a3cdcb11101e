"""The policy_checkpoint asset: the PPO update on the run's resident actor ranks (stages/policy_checkpoint.py)."""

import dagster as dg

from assets.common import record_checkpoint, train_prompt_count
from assets.stage_assets import StageRun
from stages.io.checkpoints import checkpoint_target
from stages.policy_checkpoint import update_request
from stages.run.resume import trainer_state_files


def materialize(run: StageRun) -> dg.MaterializeResult:
    """PPO update on the run's persistent gloo worker group; commits policy version iteration+1 (HF format +
    optimizer state + its trainer_state.json, stages.run.resume) and records it in the `checkpoints` table with the
    metrics the update returned, whether `rlake train` or the UI launched the run. A re-materialization retracts
    the committed version first (stages.io.checkpoints: a commit never overwrites one)."""
    cfg, it, adv = run.cfg, run.iteration, run.inputs["advantages"]
    ms = run.model_store.for_run(cfg.run_id)
    replaced = ms.retract(it + 1)
    run.ray.ensure()
    request = update_request(
        cfg,
        it,
        advantages_uri=adv.uri,
        advantages_version=adv.version,
        out_dir=checkpoint_target(ms, "policy", it + 1),
        policy_dir=ms.require(it, needed_by=f"policy update of iteration {it}"),
        extra_files=trainer_state_files(cfg, it + 1, train_prompt_count(run.rollout_store, cfg.run_id)),
    )
    metrics = run.compute(request)
    manifest = ms.manifest(it + 1)
    record_checkpoint(run.rollout_store, cfg, manifest, it, upstream={"advantages": adv.version}, metrics=metrics)
    pruned = ms.prune(cfg.trainer.save_freq, latest=it + 1)
    kl_check = ppo_kl_check(metrics, cfg.trainer.max_ppo_kl, it)
    if not kl_check.passed:
        run.log.error(kl_check.description)
    meta = {
        **metrics,
        "policy_version": it + 1,
        "path": manifest["uri"],
        "checkpoint_id": manifest["checkpoint_id"],
        "replaced_checkpoint_id": (replaced or {}).get("checkpoint_id") or "none",
        "advantages_version": int(adv.version),
        "pruned_versions": pruned,
    }
    return run.checkpoint_result("policy", it + 1, meta, [kl_check])


def ppo_kl_check(metrics: dict[str, float], limit: float | None, it: int) -> dg.AssetCheckResult:
    """Blocking gate: an update that moved the policy further than trainer.max_ppo_kl stops the run."""
    kl = float(metrics.get("actor/ppo_kl", float("nan")))
    if limit is None:
        return dg.AssetCheckResult(
            check_name="ppo_kl_within_limit", passed=True, metadata={"ppo_kl": kl, "limit": "off"}
        )
    passed = abs(kl) <= limit  # NaN fails too
    why = (
        ""
        if passed
        else (
            f"iteration {it}'s update has |actor/ppo_kl| = {abs(kl):.4g} > trainer.max_ppo_kl = {limit:g}: the new "
            "policy moved too far from the one that sampled the rollouts, so the next iteration would train on a "
            "policy the PPO clip no longer controls; lower actor.optim.lr or actor.ppo_epochs, tighten "
            "actor.clip_ratio, or raise trainer.max_ppo_kl, then re-materialize policy_checkpoint for this partition"
        )
    )
    return dg.AssetCheckResult(
        check_name="ppo_kl_within_limit",
        passed=passed,
        description=why or None,
        metadata={"ppo_kl": kl, "limit": limit, **({"message": why} if why else {})},
    )
