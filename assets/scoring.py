"""Per-iteration scoring assets: rewards and advantages."""

import time
from functools import partial

import dagster as dg
import numpy as np

from assets.common import (
    ROLLOUT,
    TRAIN,
    asset_deps,
    check_spec,
    data_version,
    iteration_of,
    lineage,
    read_if,
    read_recorded,
    run_iterations,
    timed,
    upstream_partition,
    upstream_version,
    write_table,
)
from assets.resources import RayResource, RolloutStoreResource, RunConfigResource
from configs.schema import RunConfig
from stages.advantage import uses_adaptive_kl
from stages.advantage_stream import Upstream, stream_advantages
from stages.dag import uses_critic, uses_judge, uses_reference, uses_teacher
from stages.judge import combine_judge_scores
from stages.reward import score_partition, score_rollouts
from stages.reward_model import combine_rm_scores, reward_model_scores


@dg.asset(
    partitions_def=run_iterations,
    group_name=ROLLOUT,
    kinds={"ray", "delta"},
    deps=asset_deps("scored_rollouts"),
    check_specs=[check_spec("rewards_finite", asset="scored_rollouts", blocking=True)],
)
def scored_rollouts(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    ray: RayResource,
) -> dg.MaterializeResult:
    """Rollouts with rule-based rewards by data_source (or reward.custom_reward_function's, its extra keys as
    columns), each row's reward_version recorded; re-materialize to re-score without regenerating. Rule and
    custom rewards stream the partition through the stage executor (never whole in this step); a reward model
    or judge combines in memory."""
    cfg, it = run_config.load(), iteration_of(context)
    ray.ensure()
    in_memory = cfg.reward.reward_model.enable or uses_judge(cfg)
    v, summary = (score_in_memory if in_memory else score_streaming)(context, cfg, rollout_store, it)
    bad = int((~np.isfinite(summary["reward"])).sum())
    flag = cfg.reward.on_error == "flag"  # flagged rows are expected there: advantages drops them
    return dg.MaterializeResult(
        metadata={"delta_version": v, **reward_metadata(summary)},
        data_version=data_version("scored_rollouts", v),
        check_results=[
            dg.AssetCheckResult(
                check_name="rewards_finite",
                passed=bad == 0 or (flag and bad < len(summary)),
                severity=dg.AssetCheckSeverity.WARN if flag else dg.AssetCheckSeverity.ERROR,
                metadata={"non_finite": bad, "on_error": cfg.reward.on_error},
            )
        ],
    )


SUMMARY = ["reward", "reward_fn", "reward_version"]
"""The scored_rollouts columns the asset's metadata and check read back (never the token columns)."""


def reward_metadata(summary) -> dict:
    """The scored_rollouts asset's metadata from its SUMMARY columns."""
    return {
        "reward_mean": float(np.nanmean(summary["reward"])),
        "rollouts": len(summary),
        "reward_fns": sorted(summary["reward_fn"].unique()),
        "reward_versions": sorted(summary["reward_version"].dropna().unique()),
        "reward_histogram": dg.MetadataValue.md(reward_histogram_md(summary["reward"])),
    }


def score_streaming(context, cfg: RunConfig, rollout_store: RolloutStoreResource, it: int):
    """(new version, SUMMARY columns): rule/custom rewards on the stage executor (stages/io/stage_exec.py),
    the rollouts partition read at its recorded version batch by batch, ONE commit of scored_rollouts."""
    version = upstream_version(context, rollout_store, "rollouts", cfg.run_id, it)
    run = score_partition(
        cfg.reward,
        rollout_store.uri("rollouts"),
        rollout_store.uri("scored_rollouts"),
        run_id=cfg.run_id,
        iteration=it,
        version=version,
        lineage=lambda s: lineage(
            cfg, stage="scored_rollouts", policy_version=it, upstream={"rollouts": version}, duration_s=s
        ),
        max_response_length=cfg.data.max_response_length,
        data_min_rows=cfg.ray.data_min_rows,
    )
    context.log.info(f"scored {run.rows} rollouts ({'Ray Data' if run.mode == 'ray' else 'in-process, streamed'})")
    summary, _ = rollout_store.read("scored_rollouts", cfg.run_id, it, version=run.version, columns=SUMMARY)
    return run.version, summary


def score_in_memory(context, cfg: RunConfig, rollout_store: RolloutStoreResource, it: int):
    """(new version, SUMMARY columns): rule rewards combined with a reward model's or a judge's scores, the
    partition in memory (the reward-model and judge groups take whole frames)."""
    df, version = read_recorded(context, rollout_store, "rollouts", cfg.run_id, it)
    judged, judged_version = read_if(uses_judge(cfg), context, rollout_store, "judgements", cfg.run_id, it)
    with timed() as t:
        scored = score_rollouts(df, cfg.reward, max_response_length=cfg.data.max_response_length)
        if cfg.reward.reward_model.enable:  # a discriminative reward model (stages/reward_model.py)
            scored = combine_rm_scores(scored, reward_model_scores(cfg, df), cfg.reward.reward_model.combine)
        if judged is not None:  # a generative judge's verdicts (stages/judge.py)
            scored = combine_judge_scores(scored, judged, cfg.reward.judge.combine)
    upstream = {"rollouts": version, "judgements": judged_version}
    v = write_table(
        rollout_store, cfg, "scored_rollouts", scored, it, policy_version=it, upstream=upstream, duration_s=t["s"]
    )
    return v, scored[SUMMARY]


@dg.asset(
    partitions_def=run_iterations,
    group_name=TRAIN,
    kinds={"pytorch", "delta"},
    deps=asset_deps("advantages"),
    check_specs=[check_spec("advantages_finite", asset="advantages", blocking=True)],
)
def advantages(
    context: dg.AssetExecutionContext, run_config: RunConfigResource, rollout_store: RolloutStoreResource
) -> dg.MaterializeResult:
    """Per-rollout advantages (algorithm.adv_estimator), group statistics in one pass, streamed: the step holds
    scalar columns and dense tensors, never a whole table's token lists (stages/advantage_stream.py)."""
    cfg, it = run_config.load(), iteration_of(context)

    def part(needed: bool, table: str, iteration: int = it):
        return upstream_partition(context, rollout_store, table, cfg.run_id, iteration) if needed else None

    up = Upstream(
        scored=part(True, "scored_rollouts"),
        old=part(True, "old_logprobs"),
        ref=part(uses_reference(cfg), "ref_logprobs"),
        values=part(uses_critic(cfg), "values"),
        teacher=part(uses_teacher(cfg), "teacher_logprobs"),
        previous=part(uses_adaptive_kl(cfg) and it > 0, "advantages", it - 1),  # adaptive KL: beta from it-1
    )
    tables = {"scored_rollouts": up.scored, "values": up.values, "ref_logprobs": up.ref}
    tables |= {"teacher_logprobs": up.teacher, "old_logprobs": up.old, "advantages": up.previous}
    read_versions = {t: p.version for t, p in tables.items() if p is not None}
    meta = partial(lineage, cfg, stage="advantages", policy_version=it, upstream=read_versions)
    t0 = time.perf_counter()
    run = stream_advantages(
        cfg, up, rollout_store.uri("advantages"), lineage=lambda: meta(duration_s=time.perf_counter() - t0)
    )
    if run.dropped:
        context.log.info(f"dropped {run.dropped} rollouts flagged by the reward stage (reward.on_error=flag)")
    return advantages_result(cfg, run)


def advantages_result(cfg: RunConfig, run) -> dg.MaterializeResult:
    """The advantages asset's metadata and finite check, from the stage's per-row SUMMARY columns."""
    adv = run.summary
    finite = bool(np.isfinite(adv["advantage"]).all())
    return dg.MaterializeResult(
        metadata={
            "delta_version": run.version,
            "adv_estimator": cfg.algorithm.adv_estimator,
            "advantage_abs_mean": float(adv["advantage"].abs().mean()),
            "zero_advantage_frac": float((adv["advantage"] == 0).mean()),
            "kept_groups": int(adv["group_id"].nunique()),
            "kl_coef": float(adv["kl_coef"].iloc[0]) if cfg.algorithm.use_kl_in_reward else 0.0,
            "teacher_kl_mean": float(adv["teacher_kl"].mean()) if uses_teacher(cfg) else 0.0,
            "mode": run.mode,
        },
        data_version=data_version("advantages", run.version),
        check_results=[dg.AssetCheckResult(check_name="advantages_finite", passed=finite)],
    )


def reward_histogram_md(rewards, bins: int = 10) -> str:
    """A text histogram of the partition's rewards for the asset page (Markdown table: bin, count, bar);
    non-finite rewards (reward.on_error=flag) are counted apart."""
    r = np.asarray(rewards, dtype=np.float64)
    finite = r[np.isfinite(r)]
    lines = ["| reward | count | |", "|---|---:|---|"]
    if finite.size:
        lo, hi = float(finite.min()), float(finite.max())
        counts, edges = np.histogram(
            finite, bins=bins if hi > lo else 1, range=(lo, hi) if hi > lo else (lo - 0.5, lo + 0.5)
        )
        top = max(int(counts.max()), 1)
        for c, a, b in zip(counts, edges[:-1], edges[1:], strict=True):
            lines.append(f"| [{a:.3g}, {b:.3g}) | {int(c)} | {'#' * max(round(20 * int(c) / top), 1 if c else 0)} |")
    if finite.size < r.size:
        lines.append(f"| non-finite | {r.size - finite.size} | |")
    return "\n".join(lines)
