"""Per-iteration generation assets: the prompt batch and its rollouts."""

import dagster as dg
import pandas as pd

from assets.common import ROLLOUT, iterations, read_recorded, timed, write_table
from assets.resources import ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource
from stages.dag import upstream
from stages.io.tables import PROMPTS_ITERATION
from stages.models.policy import load_tokenizer
from stages.prompt_batch import build_prompt_batch
from stages.rollout import sample_rollouts


@dg.asset(partitions_def=iterations, group_name=ROLLOUT, kinds={"delta"}, deps=upstream("prompt_batches"))
def prompt_batches(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
) -> dg.MaterializeResult:
    """This iteration's train_batch_size prompts (an epoch cursor, seeded), tokenized (stages/prompt_batch.py)."""
    cfg, it = run_config.load(), int(context.partition_key)
    rows, version = read_recorded(context, rollout_store, "prompts", cfg.run_id, PROMPTS_ITERATION)
    with timed() as t:
        tok = load_tokenizer(model_store.for_run(cfg.run_id).require(0, needed_by="prompt_batches"))
        batch = build_prompt_batch(cfg, rows, it, tok)
    v = write_table(
        rollout_store,
        cfg,
        "prompt_batches",
        batch,
        it,
        policy_version=it,
        upstream={"prompts": version},
        duration_s=t["s"],
    )
    return dg.MaterializeResult(
        metadata={"delta_version": v, "prompts": len(batch), "epoch": int(batch["epoch"].max())}
    )


@dg.asset(
    partitions_def=iterations,
    group_name=ROLLOUT,
    kinds={"ray", "delta"},
    deps=upstream("rollouts"),
    check_specs=[dg.AssetCheckSpec("responses_nonempty", asset="rollouts", blocking=True)],
)
def rollouts(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
    ray: RayResource,
) -> dg.MaterializeResult:
    """rollout.n responses per prompt from policy version == iteration, with token ids and logprobs
    (ReMax: plus one greedy baseline response per prompt, is_baseline)."""
    cfg, it = run_config.load(), int(context.partition_key)
    batch, version = read_recorded(context, rollout_store, "prompt_batches", cfg.run_id, it)
    model_dir = model_store.for_run(cfg.run_id).require(it, needed_by=f"rollouts of iteration {it}")
    ray.ensure()
    with timed() as t:
        out = sample_rollouts(
            batch.assign(group_id=batch["position"], policy_version=it), model_dir=str(model_dir), cfg=cfg, iteration=it
        )  # DAPO: rounds of gen_round until the batch is full
    v = write_table(
        rollout_store,
        cfg,
        "rollouts",
        out,
        it,
        policy_version=it,
        upstream={"prompt_batches": version},
        duration_s=t["s"],
    )
    empty = int((out["response_length"] == 0).sum())
    tokens = int(out["response_length"].sum())
    return dg.MaterializeResult(
        metadata={
            "delta_version": v,
            "rollouts": len(out),
            "engine": out["engine"].iloc[0],
            "engine_sync": ",".join(sorted(set(out["engine_sync"]))),
            "response_tokens": tokens,
            "tokens_per_s": tokens / max(t["s"], 1e-9),
            "generate_s": t["s"],
            "gen_rounds": int(out["gen_round"].nunique()),
            "baseline_rollouts": int(out["is_baseline"].sum()) if "is_baseline" in out else 0,  # ReMax greedy rows
            "samples": dg.MetadataValue.md(_sample_md(out)),
        },
        check_results=[
            dg.AssetCheckResult(check_name="responses_nonempty", passed=empty == 0, metadata={"empty_responses": empty})
        ],
    )


def _sample_md(df: pd.DataFrame, k: int = 4) -> str:
    lines = ["| prompt | response | finish |", "|---|---|---|"]

    def esc(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    for _, r in df.head(k).iterrows():
        lines.append(f"| `{esc(r['prompt_text'][-40:])}` | `{esc(r['response_text'][:60])}` | {r['finish_reason']} |")
    return "\n".join(lines)
