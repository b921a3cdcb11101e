"""The scored_rollouts asset: rewards of the rollouts, streamed batch by batch (stages/scored_rollouts.py)."""

import dagster as dg
import numpy as np

from assets.stage_assets import StageRun
from stages.scored_rollouts import ModelScores


def materialize(run: StageRun) -> dg.MaterializeResult:
    """Rollouts with rule-based rewards by data_source (or reward.custom_reward_function's, its extra keys as
    columns), each row's reward_version recorded, combined with a reward model's or judge's scores when the
    config has them; re-materialize to re-score without regenerating. The partition streams through the stage
    executor batch by batch: never whole in this step."""
    cfg = run.cfg
    run.ray.ensure()
    v, summary = score_streaming(run)
    bad = int((~np.isfinite(summary["reward"])).sum())
    flag = cfg.reward.on_error == "flag"  # flagged rows are expected there: advantages drops them
    check = dg.AssetCheckResult(
        check_name="rewards_finite",
        passed=bad == 0 or (flag and bad < len(summary)),
        severity=dg.AssetCheckSeverity.WARN if flag else dg.AssetCheckSeverity.ERROR,
        metadata={"non_finite": bad, "on_error": cfg.reward.on_error},
    )
    return run.result(v, reward_metadata(summary), [check])


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


def score_streaming(run: StageRun):
    """(new version, SUMMARY columns): rule/custom rewards on the stage executor (stages/io/stage_exec.py),
    the rollouts input read batch by batch, ONE commit of scored_rollouts. With a reward model or a judge each
    batch also gets their scores (ModelScores: the reward-model group scores the batch; the judge's verdicts are
    the judgements input's three scalar columns), in this process."""
    cfg, it = run.cfg, run.iteration
    rollouts, part = run.inputs["rollouts"], run.inputs["judgements"]
    judged = part.read(["rollout_id", "judge_score", "judge_error"]) if part is not None else None
    models = cfg.reward.reward_model.enable or judged is not None
    upstream = {"rollouts": rollouts.version} | ({"judgements": part.version} if part is not None else {})
    done = run.compute(
        cfg.reward,
        rollouts.uri,
        run.rollout_store.uri("scored_rollouts"),
        run_id=cfg.run_id,
        iteration=it,
        version=rollouts.version,
        lineage=lambda s: run.lineage(upstream, policy_version=it, duration_s=s),
        max_response_length=cfg.data.max_response_length,
        data_min_rows=cfg.ray.data_min_rows,
        then=ModelScores(cfg, judged) if models else None,
    )
    run.log.info(f"scored {done.rows} rollouts ({'Ray Data' if done.mode == 'ray' else 'in-process, streamed'})")
    summary, _ = run.rollout_store.read("scored_rollouts", cfg.run_id, it, version=done.version, columns=SUMMARY)
    return done.version, summary


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
