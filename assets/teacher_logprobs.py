"""The teacher_logprobs asset: the distillation teacher's log-probs of the rollouts (stages/teacher_logprobs.py)."""

import dagster as dg

from assets.stage_assets import StageRun
from stages.ref_logprobs import mean_log_ratio


def materialize(run: StageRun) -> dg.MaterializeResult:
    """Per-token log-probs of every response under the teacher (algorithm.distillation.teacher_model_path)."""
    # policy version 0 is the student whose tokenizer the teacher must share (stages/teacher_logprobs.py)
    results, v, seconds = run.model_pass(0)
    return run.result(
        v,
        {
            "rollouts": sum(r.rows for r in results),
            "teacher": str(run.cfg.algorithm.distillation.teacher_model_path),
            "teacher_kl_mean": mean_log_ratio(results),  # the student's sampled tokens: log pi_s - log pi_t
            "teacher_s": seconds,
        },
    )
