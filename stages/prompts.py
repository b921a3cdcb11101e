"""Ingest stage: the run's dataset (verl parquet, or the generated synthetic task) as prompts rows."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from configs.schema import RunConfig
from stages.data.datasets import generate_synthetic_task, load_prompt_rows
from stages.data.rewards import scorer_for


def build_prompt_rows(cfg: RunConfig) -> pd.DataFrame:
    """Rows of the `prompts` table (train and val splits, verl columns); generates the synthetic task under
    output_dir/data when data.train_files is empty."""
    train, val = list(cfg.data.train_files), list(cfg.data.val_files)
    if not train:
        prefix = "arith" if cfg.data.synthetic.task == "addition" else cfg.data.synthetic.task
        out = Path(cfg.trainer.output_dir) / "data" / f"{prefix}_seed{cfg.data.synthetic.seed}"
        gen_train, gen_val = generate_synthetic_task(out, cfg.data.synthetic)
        train, val = [gen_train], val or [gen_val]
    df = load_prompt_rows(train, val)
    if not cfg.reward.custom_reward_function.path:  # a custom reward function scores any data_source
        for ds in df["data_source"].unique():  # an unknown data_source fails here, before any generation
            scorer_for(ds)
    n_train = int((df["split"] == "train").sum())
    if n_train < cfg.data.train_batch_size:
        raise ValueError(
            f"{n_train} training prompts < data.train_batch_size ({cfg.data.train_batch_size}); "
            "add data or lower train_batch_size"
        )
    return df
