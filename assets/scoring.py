"""Per-iteration scoring assets: rewards and advantages."""

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
    upstream_version,
    write_table,
)
from assets.resources import RayResource, RolloutStoreResource, RunConfigResource
from stages.advantage import iteration_advantages, uses_adaptive_kl
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


def score_streaming(context, cfg, rollout_store: RolloutStoreResource, it: int):
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


def score_in_memory(context, cfg, rollout_store: RolloutStoreResource, it: int):
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
    """Per-rollout advantages (algorithm.adv_estimator), group statistics in one pass."""
    cfg, it = run_config.load(), iteration_of(context)
    scored, version = read_recorded(context, rollout_store, "scored_rollouts", cfg.run_id, it)
    values, values_version = read_if(uses_critic(cfg), context, rollout_store, "values", cfg.run_id, it)
    ref, ref_version = read_if(uses_reference(cfg), context, rollout_store, "ref_logprobs", cfg.run_id, it)
    teacher, teacher_version = read_if(uses_teacher(cfg), context, rollout_store, "teacher_logprobs", cfg.run_id, it)
    old, old_version = read_recorded(context, rollout_store, "old_logprobs", cfg.run_id, it)
    # adaptive KL-in-reward: beta of iteration it follows from iteration it-1's stored beta and KL
    adaptive = uses_adaptive_kl(cfg) and it > 0
    prev, prev_version = read_if(adaptive, context, rollout_store, "advantages", cfg.run_id, it - 1)
    with timed() as t:
        adv, dropped = iteration_advantages(
            cfg, scored, values=values, ref=ref, previous=prev, old=old, teacher=teacher
        )
    if dropped:
        context.log.info(f"dropped {dropped} rollouts flagged by the reward stage (reward.on_error=flag)")
    read_versions = {
        "scored_rollouts": version,
        "values": values_version,
        "ref_logprobs": ref_version,
        "teacher_logprobs": teacher_version,
        "old_logprobs": old_version,
        "advantages": prev_version,
    }
    v = write_table(
        rollout_store, cfg, "advantages", adv, it, policy_version=it, upstream=read_versions, duration_s=t["s"]
    )
    finite = bool(np.isfinite(adv["advantage"]).all())
    return dg.MaterializeResult(
        metadata={
            "delta_version": v,
            "adv_estimator": cfg.algorithm.adv_estimator,
            "advantage_abs_mean": float(adv["advantage"].abs().mean()),
            "zero_advantage_frac": float((adv["advantage"] == 0).mean()),
            "kept_groups": int(adv["group_id"].nunique()),
            "kl_coef": float(adv["kl_coef"].iloc[0]) if cfg.algorithm.use_kl_in_reward else 0.0,
            "teacher_kl_mean": float(adv["teacher_kl"].mean()) if uses_teacher(cfg) else 0.0,
        },
        data_version=data_version("advantages", v),
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
