"""Per-iteration optimization and bookkeeping assets: policy update and iteration metrics."""

import json

import dagster as dg
import pandas as pd

from assets.common import EVAL, TRAIN, iterations, lineage
from assets.resources import (ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource,
                              TrackerResource)
from assets.scoring import advantages
from stages.metrics import rollout_metrics
from stages.models import load_tokenizer
from stages.store import commit_lineage
from stages.tables import PROMPTS_ITERATION
from stages.update import METRICS_FILE, run_policy_update
from stages.evaluate import validate_policy


@dg.asset(partitions_def=iterations, group_name=TRAIN, kinds={"ray", "pytorch"}, deps=[advantages])
def policy_checkpoint(context: dg.AssetExecutionContext, run_config: RunConfigResource, rollout_store: RolloutStoreResource,
                      model_store: ModelStoreResource, ray: RayResource) -> dg.MaterializeResult:
    """PPO update on the run's persistent gloo worker group; writes policy version iteration+1 (HF format + optimizer state)."""
    cfg, it = run_config.load(), int(context.partition_key)
    ms = model_store.for_run(cfg.run_id)
    uri = rollout_store.uri("advantages")
    _, adv_version = rollout_store.read("advantages", cfg.run_id, it)
    job = {"run_id": cfg.run_id, "iteration": it, "advantages_uri": uri, "advantages_version": adv_version,
           "policy_dir": str(ms.require(it, needed_by=f"policy update of iteration {it}")), "out_dir": str(ms.policy_dir(it + 1)),
           "actor": cfg.actor.model_dump(mode="json"), "ppo_mini_batch_size": cfg.actor.ppo_mini_batch_size,
           "n_per_prompt": cfg.rollout.n, "seed": cfg.seed * 7 + it}
    ray.ensure()
    metrics = run_policy_update(job, num_workers=cfg.actor.num_workers)
    pruned = ms.prune(cfg.trainer.save_freq, latest=it + 1)
    return dg.MaterializeResult(metadata={**metrics, "policy_version": it + 1, "path": job["out_dir"],
                                          "advantages_version": adv_version, "pruned_versions": pruned})


@dg.asset(partitions_def=iterations, group_name=EVAL, kinds={"delta", "mlflow"}, deps=[policy_checkpoint])
def iteration_metrics(context: dg.AssetExecutionContext, run_config: RunConfigResource, rollout_store: RolloutStoreResource,
                      model_store: ModelStoreResource, tracker: TrackerResource, ray: RayResource) -> dg.MaterializeResult:
    """verl-named metrics of the iteration (+ validation every test_freq), to Delta and MLflow."""
    cfg, it = run_config.load(), int(context.partition_key)
    scored, s_v = rollout_store.read("scored_rollouts", cfg.run_id, it)
    adv, a_v = rollout_store.read("advantages", cfg.run_id, it)
    new_dir = model_store.for_run(cfg.run_id).require(it + 1, needed_by="iteration_metrics")
    m = rollout_metrics(scored, adv, cfg.data.max_response_length)
    m |= json.loads((new_dir / METRICS_FILE).read_text()) | stage_timings(rollout_store, cfg.run_id, it)
    m["timing_s/step"] = sum(m.get(f"timing_s/{k}", 0.0) for k in STEP_STAGES)
    last = it + 1 == cfg.trainer.total_training_steps
    if last or (cfg.trainer.test_freq > 0 and (it + 1) % cfg.trainer.test_freq == 0):
        ray.ensure()
        prompts, _ = rollout_store.read("prompts", cfg.run_id, PROMPTS_ITERATION)
        m |= validate_policy(str(new_dir), prompts[prompts["split"] == "val"], load_tokenizer(new_dir), cfg)
    tracker.log_metrics(tracker.run_for(cfg.run_id, cfg), m, step=it + 1)
    rows = pd.DataFrame({"policy_version": it + 1, "metric": list(m), "value": list(m.values())})
    v = rollout_store.write("iteration_metrics", rows, run_id=cfg.run_id, iteration=it, lineage=lineage(
        cfg, stage="iteration_metrics", policy_version=it + 1, upstream={"scored_rollouts": s_v, "advantages": a_v}, duration_s=0))
    keys = ("critic/score/mean", "actor/pg_loss", "actor/pg_clipfrac", "response_length/mean", "timing_s/step")
    return dg.MaterializeResult(metadata={"delta_version": v, **{k: m[k] for k in keys if k in m},
                                          **{k: v for k, v in m.items() if k.startswith("val-core/")}})


STEP_STAGES = ("prompt_batch", "rollouts", "scored_rollouts", "advantages", "update")


def stage_timings(rollout_store: RolloutStoreResource, run_id: str, it: int) -> dict[str, float]:
    """timing_s/<stage> from the newest lineage commit of each table for this iteration."""
    out = {}
    for table in ("prompt_batches", "rollouts", "scored_rollouts", "advantages"):
        commits = commit_lineage(rollout_store.uri(table), run_id=run_id, iteration=it)
        if commits:
            out[f"timing_s/{commits[0]['stage']}"] = float(commits[0]["duration_s"])
    return out
