"""The judgements asset: the generative judge's verdicts on the training rollouts (reward.judge;
stages/judgements.py)."""

import dagster as dg

from assets.stage_assets import StageRun
from stages.io.checkpoints import model_version
from stages.io.tables import PROMPTS_ITERATION


def materialize(run: StageRun) -> dg.MaterializeResult:
    """The judge's prompt, raw verdict and parsed score per rollout; unparsed verdicts are flagged rows."""
    cfg, it, source = run.cfg, run.iteration, run.inputs["rollouts"]
    prompts = run.partition("prompts", PROMPTS_ITERATION)
    run.ray.ensure()
    sink, t0 = run.sink(), run.seconds()
    results = run.compute(cfg, source, prompts, it, sink=sink)  # the judge ranks read and write the rows
    meta = run.lineage({"rollouts": source.version}, policy_version=it, duration_s=run.seconds() - t0)
    v = run.commit(sink, results, meta)
    parts = [r.summary for r in results]
    parsed = sum(p["score_n"] for p in parts)
    sample = next((p["sample"] for p in parts if p["sample"] is not None), None)
    return run.result(
        v,
        {
            "rollouts": sum(p["rows"] for p in parts),
            "judge_unparsed": sum(p["unparsed"] for p in parts),
            "judge_score_mean": sum(p["score_sum"] for p in parts) / parsed if parsed else float("nan"),
            "judge_model": model_version(cfg.reward.judge.model_path),
            "sample_verdict": dg.MetadataValue.md(f"```\n{sample[:500]}\n```") if sample is not None else "",
            "judge_s": run.seconds() - t0,
        },
    )
