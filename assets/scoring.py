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
    run_iterations,
    upstream_partition,
    upstream_version,
)
from assets.resources import RayResource, RolloutStoreResource, RunConfigResource
from configs.schema import RunConfig
from stages.advantage_table import uses_adaptive_kl
from stages.advantages import Upstream, stream_advantages
from stages.dag import uses_critic, uses_judge, uses_reference, uses_teacher
from stages.scored_rollouts import ModelScores, score_partition
from stages.scored_tokens import ScoredRollouts


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
    columns), each row's reward_version recorded, combined with a reward model's or judge's scores when the
    config has them; re-materialize to re-score without regenerating. The partition streams through the stage
    executor batch by batch: never whole in this step."""
    cfg, it = run_config.load(), iteration_of(context)
    ray.ensure()
    v, summary = score_streaming(context, cfg, rollout_store, it)
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
    the rollouts partition read at its recorded version batch by batch, ONE commit of scored_rollouts. With a
    reward model or a judge each batch also gets their scores (ModelScores: the reward-model group scores the
    batch; the judge's verdicts are the judgements partition's three scalar columns), in this process."""
    version = upstream_version(context, rollout_store, "rollouts", cfg.run_id, it)
    judged = part = None
    if uses_judge(cfg):
        part = upstream_partition(context, rollout_store, "judgements", cfg.run_id, it)
        judged = part.read(["rollout_id", "judge_score", "judge_error"])
    models = cfg.reward.reward_model.enable or judged is not None
    upstream = {"rollouts": version} | ({"judgements": part.version} if part is not None else {})
    run = score_partition(
        cfg.reward,
        rollout_store.uri("rollouts"),
        rollout_store.uri("scored_rollouts"),
        run_id=cfg.run_id,
        iteration=it,
        version=version,
        lineage=lambda s: lineage(cfg, stage="scored_rollouts", policy_version=it, upstream=upstream, duration_s=s),
        max_response_length=cfg.data.max_response_length,
        data_min_rows=cfg.ray.data_min_rows,
        then=ModelScores(cfg, judged) if models else None,
    )
    context.log.info(f"scored {run.rows} rollouts ({'Ray Data' if run.mode == 'ray' else 'in-process, streamed'})")
    summary, _ = rollout_store.read("scored_rollouts", cfg.run_id, it, version=run.version, columns=SUMMARY)
    return run.version, summary


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
    scalar columns and dense tensors, never a whole table's token lists (stages/advantages.py)."""
    cfg, it = run_config.load(), iteration_of(context)

    def part(needed: bool, table: str, iteration: int = it):
        return upstream_partition(context, rollout_store, table, cfg.run_id, iteration) if needed else None

    rollouts = part(True, "rollouts")  # the token columns, stored there once (stages/scored_tokens.py)
    up = Upstream(
        scored=ScoredRollouts(part(True, "scored_rollouts"), rollouts),
        old=part(True, "old_logprobs"),
        ref=part(uses_reference(cfg), "ref_logprobs"),
        values=part(uses_critic(cfg), "values"),
        teacher=part(uses_teacher(cfg), "teacher_logprobs"),
        previous=part(uses_adaptive_kl(cfg) and it > 0, "advantages", it - 1),  # adaptive KL: beta from it-1
    )
    tables = {"scored_rollouts": up.scored, "rollouts": rollouts, "values": up.values, "ref_logprobs": up.ref}
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
