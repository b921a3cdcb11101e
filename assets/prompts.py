"""The prompts asset: the run's dataset in verl's format (stages/prompts.py)."""

import dagster as dg

from assets.stage_assets import StageRun


def materialize(run: StageRun) -> dg.MaterializeResult:
    """The run's dataset in verl's format (train and val splits); one Delta partition per run."""
    df = run.compute(run.cfg)
    version = run.write(df, upstream={}, policy_version=None)
    counts = df["split"].value_counts().to_dict()
    return run.result(
        version,
        {
            "rows": len(df),
            "train": counts.get("train", 0),
            "val": counts.get("val", 0),
            "data_sources": sorted(df["data_source"].unique()),
        },
    )
