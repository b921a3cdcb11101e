"""The prompt_batches asset: this iteration's prompts, tokenized (stages/prompt_batches.py)."""

import dagster as dg

from assets.stage_assets import StageRun
from stages.models.policy import load_tokenizer


def materialize(run: StageRun) -> dg.MaterializeResult:
    """This iteration's train_batch_size prompts (an epoch cursor, seeded), tokenized (stages/prompt_batches.py)."""
    cfg, it = run.cfg, run.iteration
    rows, version = run.frame("prompts")
    t0 = run.seconds()
    tok = load_tokenizer(run.model_store.for_run(cfg.run_id).fetch_tokenizer(0, needed_by="prompt_batches"))
    batch = run.compute(cfg, rows, it, tok)
    v = run.write(batch, upstream={"prompts": version}, policy_version=it, duration_s=run.seconds() - t0)
    return run.result(v, {"prompts": len(batch), "epoch": int(batch["epoch"].max())})
