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
    record_checkpoint,
    runs,
    timed,
    write_table,
)
from assets.resources import ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource, TrackerResource
from configs.schema import RunConfig
from stages.evaluate import validation_rollouts, validation_summary
from stages.initial_policy import create_initial_policy
from stages.io.checkpoints import checkpoint_target
from stages.io.tables import PROMPTS_ITERATION
from stages.models.policy import load_tokenizer
from stages.prompts import build_prompt_rows
from stages.run.resume import trainer_state_files


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
    """Policy version 0 (tiny model warm-started, or a copy of model.path) with its trainer_state.json
    (stages.run.resume), committed and recorded in the `checkpoints` table, validated before training."""
    cfg = run_config.load()
    rows, prompts_version = read_recorded(context, rollout_store, "prompts", cfg.run_id, PROMPTS_ITERATION)
    ms, meta, manifest = commit_initial_policy(cfg, rows, rollout_store, model_store, prompts_version)
    ray.ensure()
    model_dir, tok = str(ms.require(0, needed_by="initial_policy")), load_tokenizer(ms.fetch_tokenizer(0))
    scored = validation_rollouts(model_dir, rows[rows["split"] == "val"], tok, cfg)
    val = validation_summary(scored)
    mlflow_id = tracker.run_for(cfg.run_id, cfg, step=0)
    tracker.log_metrics(mlflow_id, val, step=0)
    metrics = pd.DataFrame({"policy_version": 0, "metric": list(val), "value": list(val.values())})
    upstream = {"prompts": prompts_version}
    version = write_table(
        rollout_store, cfg, "iteration_metrics", metrics, PROMPTS_ITERATION, policy_version=0, upstream=upstream,
        stage="initial_policy",
    )  # fmt: skip
    tracker.log_iteration(
        mlflow_id, rollout_store.location, cfg.run_id, PROMPTS_ITERATION, metrics_version=version, policy_version=0,
        validation=scored,
    )  # fmt: skip
    return dg.MaterializeResult(
        metadata={
            **meta,
            **val,
            "path": manifest["uri"],
            "checkpoint_id": manifest["checkpoint_id"],
            "metrics_delta_version": version,
        },  # fmt: skip
        data_version=checkpoint_version("policy", 0, context),
    )


def commit_initial_policy(cfg: RunConfig, rows: pd.DataFrame, rollout_store, model_store, prompts_version: int):
    """(ModelStore, metadata, manifest): policy version 0 with its trainer_state.json committed (a
    re-materialization retracts the committed one first) and recorded in the `checkpoints` table."""
    ms, train = model_store.for_run(cfg.run_id), rows[rows["split"] == "train"]
    ms.retract(0)
    state = trainer_state_files(cfg, 0, len(train))
    meta = create_initial_policy(cfg.model, train, checkpoint_target(ms, "policy", 0), seed=cfg.seed, extra_files=state)
    manifest = ms.manifest(0)
    record_checkpoint(rollout_store, cfg, manifest, PROMPTS_ITERATION, upstream={"prompts": prompts_version})
    return ms, meta, manifest
