"""The rollouts asset: rollout.n responses per prompt from the run's rollout workers (stages/rollouts.py)."""

import dagster as dg

from assets.stage_assets import StageRun
from stages.rollout_shards import merge_summaries


def materialize(run: StageRun) -> dg.MaterializeResult:
    """rollout.n responses per prompt, with token ids and logprobs, from policy version == iteration
    (trainer.async_mode=one_step_off: iteration - 1, at least 0); ReMax: plus one greedy baseline response per
    prompt, is_baseline. The version used is each row's policy_version, the commit's and this materialization's."""
    cfg, it = run.cfg, run.iteration
    policy = cfg.trainer.rollout_version(it)
    batch, version = run.frame("prompt_batches")
    ms = run.model_store.for_run(cfg.run_id)
    model_dir = ms.require(policy, needed_by=f"rollouts of iteration {it}")
    run.ray.ensure()
    sink, t0 = run.sink(), run.seconds()
    results = run.compute(  # the ranks write their rows; DAPO: rounds of gen_round until the batch is full
        batch.assign(group_id=batch["position"], policy_version=policy),
        model_dir=str(model_dir),
        cfg=cfg,
        iteration=it,
        sink=sink,
    )
    seconds = run.seconds() - t0
    v = run.commit(sink, results, run.lineage({"prompt_batches": version}, policy_version=policy, duration_s=seconds))
    done = merge_summaries([r.summary for r in results])
    empty = done["empty_responses"]
    checks = [
        dg.AssetCheckResult(check_name="responses_nonempty", passed=empty == 0, metadata={"empty_responses": empty}),
        weights_check(done["fingerprints"], done["rows"], ms.policy_fingerprint(policy), policy),
    ]
    meta = {"policy_version": policy, "policy_lag": it - policy, **rollout_metadata(done, seconds)}
    return run.result(v, meta, checks)


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
