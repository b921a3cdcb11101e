"""Per-iteration optimization and bookkeeping assets: policy update and iteration metrics."""

import dagster as dg
import pandas as pd

from assets.common import (
    EVAL,
    TRAIN,
    asset_deps,
    check_spec,
    checkpoint_metrics,
    checkpoint_version,
    data_version,
    iteration_of,
    read_recorded,
    record_checkpoint,
    run_iterations,
    timed,
    train_prompt_count,
    upstream_partition,
    upstream_version,
    write_table,
)
from assets.resources import ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource, TrackerResource
from configs.schema import RunConfig
from stages.dag import ITERATION, uses_critic
from stages.evaluate import validation_rollouts, validation_summary
from stages.io.checkpoints import checkpoint_target
from stages.io.plots import run_curves_markdown
from stages.io.store import newest_commit, pinned
from stages.io.tables import PROMPTS_ITERATION
from stages.iteration_metrics import iteration_metrics as compute_iteration_metrics
from stages.iteration_metrics import validates
from stages.models.policy import load_tokenizer
from stages.policy_checkpoint import run_update, update_request
from stages.run.resume import trainer_state_files
from stages.scored_tokens import ScoredRollouts
from stages.workers.group import worker_placements


@dg.asset(
    partitions_def=run_iterations,
    group_name=TRAIN,
    kinds={"ray", "pytorch"},
    deps=asset_deps("policy_checkpoint"),
    check_specs=[
        check_spec(
            "ppo_kl_within_limit",
            asset="policy_checkpoint",
            blocking=True,
            description="|actor/ppo_kl| <= trainer.max_ppo_kl (null: off)",
        )
    ],
)
def policy_checkpoint(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
    ray: RayResource,
) -> dg.MaterializeResult:
    """PPO update on the run's persistent gloo worker group; commits policy version iteration+1 (HF format +
    optimizer state + its trainer_state.json, stages.run.resume) and records it in the `checkpoints` table with the
    metrics the update returned, whether `rlake train` or the UI launched the run. A re-materialization retracts
    the committed version first (stages.io.checkpoints: a commit never overwrites one)."""
    cfg, it = run_config.load(), iteration_of(context)
    ms = model_store.for_run(cfg.run_id)
    adv_version = upstream_version(context, rollout_store, "advantages", cfg.run_id, it)
    replaced = ms.retract(it + 1)
    ray.ensure()
    request = update_request(
        cfg,
        it,
        advantages_uri=rollout_store.uri("advantages"),
        advantages_version=adv_version,
        out_dir=checkpoint_target(ms, "policy", it + 1),
        policy_dir=ms.require(it, needed_by=f"policy update of iteration {it}"),
        extra_files=trainer_state_files(cfg, it + 1, train_prompt_count(rollout_store, cfg.run_id)),
    )
    metrics = run_update(request)
    manifest = ms.manifest(it + 1)
    record_checkpoint(rollout_store, cfg, manifest, it, upstream={"advantages": adv_version}, metrics=metrics)
    pruned = ms.prune(cfg.trainer.save_freq, latest=it + 1)
    kl_check = ppo_kl_check(metrics, cfg.trainer.max_ppo_kl, it)
    if not kl_check.passed:
        context.log.error(kl_check.description)
    return dg.MaterializeResult(
        metadata={
            **metrics,
            "policy_version": it + 1,
            "path": manifest["uri"],
            "checkpoint_id": manifest["checkpoint_id"],
            "replaced_checkpoint_id": (replaced or {}).get("checkpoint_id") or "none",
            "advantages_version": int(adv_version),
            "pruned_versions": pruned,
        },
        data_version=checkpoint_version("policy", it + 1, context),
        check_results=[kl_check],
    )


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


@dg.asset(
    partitions_def=run_iterations, group_name=EVAL, kinds={"delta", "mlflow"}, deps=asset_deps("iteration_metrics")
)
def iteration_metrics(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
    tracker: TrackerResource,
    ray: RayResource,
) -> dg.MaterializeResult:
    """verl-named metrics of the iteration (+ validation every test_freq), to Delta and MLflow. Its tables are
    done when it runs: each is looked up once (stages.io.store.pinned), not once per read."""
    with pinned():
        cfg, it = run_config.load(), iteration_of(context)
        m, val, read_versions = measure_iteration(context, cfg, rollout_store, model_store, ray)
        mlflow_id = tracker.run_for(cfg.run_id, cfg, step=it + 1)
        tracker.log_metrics(mlflow_id, m, step=it + 1)
        rows = pd.DataFrame({"policy_version": it + 1, "metric": list(m), "value": list(m.values())})
        v = write_table(
            rollout_store, cfg, "iteration_metrics", rows, it, policy_version=it + 1, upstream=read_versions
        )
        tracker.log_iteration(
            mlflow_id, rollout_store.location, cfg.run_id, it, metrics_version=v, policy_version=it + 1, validation=val
        )
        ray.ensure()  # where the run's workers are now (the recorded placement; SQL over the `workers` table)
        placed = pd.DataFrame(worker_placements(cfg.run_id))
        if len(placed):
            write_table(rollout_store, cfg, "workers", placed, it, policy_version=it + 1, upstream={})
        if it + 1 == cfg.trainer.total_training_steps:  # the run is complete: its validation curve, then FINISHED
            tracker.end_run(cfg.run_id, "FINISHED", tables_root=rollout_store.location)
        curves = run_curves_markdown(rollout_store.location, cfg.run_id)
    return dg.MaterializeResult(
        metadata={
            "delta_version": v,
            **{k: m[k] for k in SUMMARY_METRICS if k in m},
            **{k: v for k, v in m.items() if k.startswith("val-core/")},
            "run_curves": dg.MetadataValue.md(curves),
        },
        data_version=data_version("iteration_metrics", v),
    )


def measure_iteration(
    context, cfg: RunConfig, rollout_store, model_store, ray
) -> tuple[dict[str, float], dict | None, dict]:
    """(the iteration's metrics, its validation rollouts or None, the table versions read): the iteration_metrics
    stage over the iteration's recorded partitions, the updates' recorded metrics, the stages' timings and, when
    it validates, the validation of the new policy."""
    it = iteration_of(context)
    rollouts = upstream_partition(context, rollout_store, "rollouts", cfg.run_id, it)  # the token columns
    scored = ScoredRollouts(upstream_partition(context, rollout_store, "scored_rollouts", cfg.run_id, it), rollouts)
    adv = upstream_partition(context, rollout_store, "advantages", cfg.run_id, it)
    critic_used = uses_critic(cfg)  # the values partition streamed like the others
    values = upstream_partition(context, rollout_store, "values", cfg.run_id, it) if critic_used else None
    ms = model_store.for_run(cfg.run_id)
    new_dir = ms.require(it + 1, needed_by="iteration_metrics")
    update, c_v = checkpoint_metrics(rollout_store, cfg.run_id, it, "policy", it + 1)
    critic = checkpoint_metrics(rollout_store, cfg.run_id, it, "critic", it + 1)[0] if values is not None else None
    timings = stage_timings(rollout_store, cfg.run_id, it)
    m = compute_iteration_metrics(
        scored, adv, update_metrics=update, timings=timings, values=values, critic_update_metrics=critic
    )
    val, val_metrics = validation(context, cfg, rollout_store, ms, ray, it, new_dir)
    read_versions = {"scored_rollouts": scored.version, "rollouts": rollouts.version, "advantages": adv.version}
    read_versions["checkpoints"] = c_v
    return m | val_metrics, val, read_versions


def validation(
    context, cfg: RunConfig, rollout_store, ms, ray, it: int, new_dir
) -> tuple[dict | None, dict[str, float]]:
    """(validation rollouts by sampling mode, their val-core metrics and timing_s/testing: the seconds it took)
    when iteration `it`'s new policy is validated (stages.iteration_metrics.validates), else (None, {})."""
    if not validates(cfg, it):
        return None, {}
    with timed() as t:
        ray.ensure()
        prompts, _ = read_recorded(context, rollout_store, "prompts", cfg.run_id, PROMPTS_ITERATION)
        tok = load_tokenizer(ms.fetch_tokenizer(it + 1))
        val = validation_rollouts(str(new_dir), prompts[prompts["split"] == "val"], tok, cfg)
        summary = validation_summary(val)
    return val, {**summary, "timing_s/testing": t["s"]}


SUMMARY_METRICS = (
    "critic/score/mean",
    "critic/vf_loss",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/reward_kl_penalty",
    "actor/teacher_kl",
    "training/rollout_probs_diff_mean",
    "response_length/mean",
    "timing_s/step",
)
"""The iteration_metrics asset's metadata (Dagster UI, plotted across partitions on the asset's Plots tab, every
run's partitions on one axis), besides val-core/* and `run_curves` (the curves of the partition's run alone, up
to that iteration: stages.io.plots.run_curves_markdown); every metric goes to Delta and MLflow."""


def stage_timings(rollout_store: RolloutStoreResource, run_id: str, it: int) -> dict[str, float]:
    """The timing metric (stages/dag.py) of each timed stage that writes a table, from the duration in the
    newest lineage commit of its table for this iteration (read down to that commit only: store.newest_commit);
    the updates report theirs in their own metrics."""
    out = {}
    for stage in (s for s in ITERATION if s.table and s.timing):
        commit = newest_commit(rollout_store.uri(stage.name), run_id, it)  # ref_logprobs: only in runs with KL
        if commit is not None:
            out[stage.timing] = float(commit["duration_s"])
    return out
