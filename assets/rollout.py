"""Per-iteration generation assets: the prompt batch and its rollouts."""

import dagster as dg

from assets.common import (
    ROLLOUT,
    asset_deps,
    check_spec,
    data_version,
    iteration_of,
    lineage,
    outside_dag,
    read_recorded,
    run_iterations,
    timed,
    upstream_partition,
    write_table,
)
from assets.resources import ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource
from stages.io.stage_exec import read_columns, run_table_stage
from stages.io.tables import PROMPTS_ITERATION
from stages.models.policy import load_tokenizer
from stages.prompt_batches import build_prompt_batch
from stages.rollout_shards import merge_summaries
from stages.rollouts import sample_rollouts
from stages.turns import turns_table
from stages.workers.shard_io import Sink
from stages.workers.sharded import commit_shards


@dg.asset(partitions_def=run_iterations, group_name=ROLLOUT, kinds={"delta"}, deps=asset_deps("prompt_batches"))
def prompt_batches(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
) -> dg.MaterializeResult:
    """This iteration's train_batch_size prompts (an epoch cursor, seeded), tokenized (stages/prompt_batches.py)."""
    cfg, it = run_config.load(), iteration_of(context)
    rows, version = read_recorded(context, rollout_store, "prompts", cfg.run_id, PROMPTS_ITERATION)
    with timed() as t:
        tok = load_tokenizer(model_store.for_run(cfg.run_id).fetch_tokenizer(0, needed_by="prompt_batches"))
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
        metadata={"delta_version": v, "prompts": len(batch), "epoch": int(batch["epoch"].max())},
        data_version=data_version("prompt_batches", v),
    )


@dg.asset(
    partitions_def=run_iterations,
    group_name=ROLLOUT,
    kinds={"ray", "delta"},
    deps=asset_deps("rollouts"),
    check_specs=[
        check_spec("responses_nonempty", asset="rollouts", blocking=True),
        check_spec(
            "engine_weights_match_policy",
            asset="rollouts",
            blocking=True,
            description="every rollout's engine_weights_fingerprint == the fingerprint of the policy checkpoint "
            "that should have generated it (weights that never reached the engine stop the iteration)",
        ),
    ],
)
def rollouts(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
    ray: RayResource,
) -> dg.MaterializeResult:
    """rollout.n responses per prompt, with token ids and logprobs, from policy version == iteration
    (trainer.async_mode=one_step_off: iteration - 1, at least 0); ReMax: plus one greedy baseline response per
    prompt, is_baseline. The version used is each row's policy_version, the commit's and this materialization's."""
    cfg, it = run_config.load(), iteration_of(context)
    policy = cfg.trainer.rollout_version(it)
    batch, version = read_recorded(context, rollout_store, "prompt_batches", cfg.run_id, it)
    model_dir = model_store.for_run(cfg.run_id).require(policy, needed_by=f"rollouts of iteration {it}")
    ray.ensure()
    sink = Sink(rollout_store.uri("rollouts"), "rollouts", cfg.run_id, it)
    with timed() as t:
        results = sample_rollouts(  # the ranks write their rows; DAPO: rounds of gen_round until the batch is full
            batch.assign(group_id=batch["position"], policy_version=policy),
            model_dir=str(model_dir),
            cfg=cfg,
            iteration=it,
            sink=sink,
        )
    meta = lineage(
        cfg, stage="rollouts", policy_version=policy, upstream={"prompt_batches": version}, duration_s=t["s"]
    )
    v = commit_shards(sink, results, meta)
    done = merge_summaries([r.summary for r in results])
    empty = done["empty_responses"]
    return dg.MaterializeResult(
        metadata={
            "delta_version": v,
            "policy_version": policy,
            "policy_lag": it - policy,
            **rollout_metadata(done, t["s"]),
        },
        data_version=data_version("rollouts", v),
        check_results=[
            dg.AssetCheckResult(
                check_name="responses_nonempty", passed=empty == 0, metadata={"empty_responses": empty}
            ),
            weights_check(
                done["fingerprints"], done["rows"], model_store.for_run(cfg.run_id).policy_fingerprint(policy), policy
            ),
        ],
    )


@dg.asset(partitions_def=run_iterations, group_name=ROLLOUT, kinds={"delta"}, deps=asset_deps("turns"))
def turns(
    context: dg.AssetExecutionContext, run_config: RunConfigResource, rollout_store: RolloutStoreResource
) -> dg.MaterializeResult:
    """Multi-turn rollouts: one row per assistant turn and tool observation of every trajectory, with its token
    span, tool name, arguments, observation, latency and error (stages/turns.py)."""
    cfg, it = run_config.load(), iteration_of(context)
    if skipped := outside_dag(cfg, "turns"):
        return skipped
    source = upstream_partition(context, rollout_store, "rollouts", cfg.run_id, it)
    policy = cfg.trainer.rollout_version(it)
    run = run_table_stage(  # batch by batch: a rollout's turns depend on its row alone
        turns_table,
        source.uri,
        rollout_store.uri("turns"),
        "turns",
        run_id=cfg.run_id,
        iteration=it,
        version=source.version,
        lineage=lambda s: lineage(
            cfg, stage="turns", policy_version=policy, upstream={"rollouts": source.version}, duration_s=s
        ),
        data_min_rows=cfg.ray.data_min_rows,
    )
    v = run.version
    out = read_columns(rollout_store.uri("turns"), cfg.run_id, it, ["role", "error", "rollout_id"], version=v)
    tool = out[out["role"] == "tool"]
    return dg.MaterializeResult(
        metadata={
            "delta_version": v,
            "turns": len(out),
            "tool_calls": len(tool),
            "tool_errors": int(tool["error"].notna().sum()),
            "rollouts_with_tool_calls": int(tool["rollout_id"].nunique()),
        },
        data_version=data_version("turns", v),
    )


def rollout_metadata(done: dict, seconds: float) -> dict:
    """The rollouts asset's metadata from the ranks' merged summaries (stages/rollout_shards.py): counts, engine,
    throughput (floats Dagster plots) and sample responses."""
    tokens, rows = done["response_tokens"], done["rows"]
    return {
        "rollouts": rows,
        "engine": ",".join(done["engines"]),
        "engine_sync": ",".join(done["engine_sync"]),
        "response_tokens": tokens,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "response_length_mean": tokens / rows if rows else 0.0,
        "generate_s": seconds,
        "gen_rounds": len(done["gen_rounds"]),
        "baseline_rollouts": done["baselines"],  # ReMax greedy rows
        "samples": dg.MetadataValue.md(_sample_md(done["samples"])),
    }


def weights_check(fingerprints: dict[str, int], rows: int, expected: str, version: int) -> dg.AssetCheckResult:
    """Blocking gate: the engines generated with policy version `version`'s weights. Each rollout row carries the
    fingerprint its engine read from its own weights after its last load (stages/models/fingerprint.py);
    `fingerprints` counts the rows per fingerprint ("<none>": the engine did not say, a mismatch); `expected` is
    that of the checkpoint."""
    bad = {k: v for k, v in fingerprints.items() if k != expected}
    mismatched = sum(bad.values())
    why = ""
    if bad:
        why = (
            f"{mismatched} of {rows} rollouts were generated with weights whose fingerprint "
            f"({', '.join(sorted(bad))}) is not policy version {version}'s ({expected}): the engine did "
            "not get the weights it was synced to (a skipped or failed weight sync), so these rollouts are "
            "off-policy samples of another model. The iteration stops here; look at the rollouts' engine_sync "
            "column and the engine's log, then re-materialize rollouts for this partition"
        )
    return dg.AssetCheckResult(
        check_name="engine_weights_match_policy",
        passed=not bad,
        description=why or None,
        metadata={
            "policy_version": version,
            "checkpoint_fingerprint": expected,
            "engine_fingerprints": dg.MetadataValue.json(dict(fingerprints)),
            "mismatched_rollouts": mismatched,
            **({"message": why} if why else {}),
        },
    )


def _sample_md(samples: list[dict]) -> str:
    lines = ["| prompt | response | finish |", "|---|---|---|"]

    def esc(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    for r in samples:
        lines.append(f"| `{esc(r['prompt_text'][-40:])}` | `{esc(r['response_text'][:60])}` | {r['finish_reason']} |")
    return "\n".join(lines)
