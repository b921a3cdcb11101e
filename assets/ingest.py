"""Run set-up assets: the prompts table and the initial policy (version 0)."""

import dagster as dg
import pandas as pd

from assets.common import (
    DATA,
    TRAIN,
    asset_deps,
    checkpoint_version,
    data_version,
    read_recorded,
    runs,
    timed,
    write_table,
)
from assets.resources import ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource, TrackerResource
from stages.evaluate import validation_rollouts, validation_summary
from stages.initial_policy import create_initial_policy
from stages.io.tables import PROMPTS_ITERATION
from stages.models.policy import load_tokenizer
from stages.prompts import build_prompt_rows
from stages.run.resume import save_trainer_state


@dg.asset(partitions_def=runs, group_name=DATA, kinds={"delta"})
def prompts(run_config: RunConfigResource, rollout_store: RolloutStoreResource) -> dg.MaterializeResult:
    """The run's dataset in verl's format (train and val splits); one Delta partition per run."""
    cfg = run_config.load()
    with timed() as t:
        df = build_prompt_rows(cfg)
    version = write_table(
        rollout_store, cfg, "prompts", df, PROMPTS_ITERATION, policy_version=None, upstream={}, duration_s=t["s"]
    )
    counts = df["split"].value_counts().to_dict()
    return dg.MaterializeResult(
        metadata={
            "delta_version": version,
            "rows": len(df),
            "train": counts.get("train", 0),
            "val": counts.get("val", 0),
            "data_sources": sorted(df["data_source"].unique()),
        },
        data_version=data_version("prompts", version),
    )


@dg.asset(partitions_def=runs, group_name=TRAIN, kinds={"pytorch"}, deps=asset_deps("initial_policy"))
def initial_policy(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
    ray: RayResource,
    tracker: TrackerResource,
) -> dg.MaterializeResult:
    """Policy version 0 (tiny model warm-started, or a copy of model.path), validated before training, and its
    trainer_state.json (stages.run.resume)."""
    cfg = run_config.load()
    rows, prompts_version = read_recorded(context, rollout_store, "prompts", cfg.run_id, PROMPTS_ITERATION)
    out = model_store.for_run(cfg.run_id).policy_dir(0)
    meta = create_initial_policy(cfg.model, rows[rows["split"] == "train"], out, seed=cfg.seed)
    ray.ensure()
    tok = load_tokenizer(out)
    scored = validation_rollouts(str(out), rows[rows["split"] == "val"], tok, cfg)
    val = validation_summary(scored, cfg.rollout.n)
    mlflow_id = tracker.run_for(cfg.run_id, cfg, step=0)
    tracker.log_metrics(mlflow_id, val, step=0)
    metrics = pd.DataFrame({"policy_version": 0, "metric": list(val), "value": list(val.values())})
    read_versions = {"prompts": prompts_version}
    version = write_table(
        rollout_store,
        cfg,
        "iteration_metrics",
        metrics,
        PROMPTS_ITERATION,
        policy_version=0,
        upstream=read_versions,
        stage="initial_policy",
    )
    tracker.log_iteration(
        mlflow_id,
        rollout_store.root,
        cfg.run_id,
        PROMPTS_ITERATION,
        metrics_version=version,
        policy_version=0,
        validation=scored,
    )
    save_trainer_state(cfg, out, 0, int((rows["split"] == "train").sum()))
    return dg.MaterializeResult(
        metadata={**meta, **val, "path": str(out), "metrics_delta_version": version},
        data_version=checkpoint_version("policy", 0, context),
    )
