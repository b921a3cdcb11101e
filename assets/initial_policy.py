"""The initial_policy asset: policy version 0, committed and validated (stages/initial_policy.py)."""

import dagster as dg
import pandas as pd

from assets.common import record_checkpoint
from assets.stage_assets import StageRun
from stages.evaluate import validation_rollouts, validation_summary
from stages.io.checkpoints import checkpoint_target
from stages.models.policy import load_tokenizer
from stages.run.resume import trainer_state_files


def materialize(run: StageRun) -> dg.MaterializeResult:
    """Policy version 0 (tiny model warm-started, or a copy of model.path) with its trainer_state.json
    (stages.run.resume), committed and recorded in the `checkpoints` table, validated before training."""
    cfg = run.cfg
    rows, prompts_version = run.frame("prompts")
    ms, meta, manifest = commit_initial_policy(run, rows, prompts_version)
    run.ray.ensure()
    model_dir, tok = str(ms.require(0, needed_by="initial_policy")), load_tokenizer(ms.fetch_tokenizer(0))
    scored = validation_rollouts(model_dir, rows[rows["split"] == "val"], tok, cfg)
    val = validation_summary(scored)
    mlflow_id = run.tracker.run_for(cfg.run_id, cfg, step=0)
    run.tracker.log_metrics(mlflow_id, val, step=0)
    metrics = pd.DataFrame({"policy_version": 0, "metric": list(val), "value": list(val.values())})
    version = run.write(
        metrics, upstream={"prompts": prompts_version}, policy_version=0, table="iteration_metrics", duration_s=0.0
    )
    run.tracker.log_iteration(
        mlflow_id, run.rollout_store.location, cfg.run_id, run.iteration, metrics_version=version, policy_version=0,
        validation=scored,
    )  # fmt: skip
    return run.checkpoint_result(
        "policy",
        0,
        {
            **meta,
            **val,
            "path": manifest["uri"],
            "checkpoint_id": manifest["checkpoint_id"],
            "metrics_delta_version": version,
        },
    )


def commit_initial_policy(run: StageRun, rows: pd.DataFrame, prompts_version: int):
    """(ModelStore, metadata, manifest): policy version 0 with its trainer_state.json committed (a
    re-materialization retracts the committed one first) and recorded in the `checkpoints` table."""
    cfg = run.cfg
    ms, train = run.model_store.for_run(cfg.run_id), rows[rows["split"] == "train"]
    ms.retract(0)
    state = trainer_state_files(cfg, 0, len(train))
    meta = run.compute(cfg.model, train, checkpoint_target(ms, "policy", 0), seed=cfg.seed, extra_files=state)
    manifest = ms.manifest(0)
    record_checkpoint(run.rollout_store, cfg, manifest, run.iteration, upstream={"prompts": prompts_version})
    return ms, meta, manifest
