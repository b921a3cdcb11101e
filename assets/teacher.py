"""The distillation teacher's log-probs of each iteration's rollouts (algorithm.distillation, on-policy)."""

import dagster as dg

from assets.common import ROLLOUT, asset_deps, data_version, model_logprob_table, outside_dag, run_iterations
from assets.resources import ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource
from stages.ref_logprobs import mean_log_ratio
from stages.teacher_logprobs import teacher_logprobs as compute_teacher_logprobs


@dg.asset(
    partitions_def=run_iterations,
    group_name=ROLLOUT,
    kinds={"ray", "pytorch", "delta"},
    deps=asset_deps("teacher_logprobs"),
)
def teacher_logprobs(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
    ray: RayResource,
) -> dg.MaterializeResult:
    """Per-token log-probs of every response under the teacher (algorithm.distillation.teacher_model_path)."""
    cfg = run_config.load()
    if skipped := outside_dag(cfg, "teacher_logprobs"):
        return skipped
    # policy version 0 is the student whose tokenizer the teacher must share (stages/teacher_logprobs.py)
    results, v, seconds = model_logprob_table(
        context, cfg, rollout_store, model_store, ray,
        table="teacher_logprobs", model_version=0, compute=compute_teacher_logprobs,
    )  # fmt: skip
    return dg.MaterializeResult(
        metadata={
            "delta_version": v,
            "rollouts": sum(r.rows for r in results),
            "teacher": str(cfg.algorithm.distillation.teacher_model_path),
            "teacher_kl_mean": mean_log_ratio(results),  # the student's sampled tokens: log pi_s - log pi_t
            "teacher_s": seconds,
        },
        data_version=data_version("teacher_logprobs", v),
    )
