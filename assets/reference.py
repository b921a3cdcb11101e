"""Reference-policy log-probs of each iteration's rollouts (KL loss / KL in reward)."""

import dagster as dg

from assets.common import ROLLOUT, asset_deps, data_version, model_logprob_table, outside_dag, run_iterations
from assets.resources import ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource
from stages.old_logprobs import engine_minus
from stages.ref_logprobs import REF_POLICY_VERSION, reference_logprobs


@dg.asset(
    partitions_def=run_iterations,
    group_name=ROLLOUT,
    kinds={"ray", "pytorch", "delta"},
    deps=asset_deps("ref_logprobs"),
)
def ref_logprobs(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
    ray: RayResource,
) -> dg.MaterializeResult:
    """Per-token log-probs of every response under the reference policy (policy version 0)."""
    cfg = run_config.load()
    if skipped := outside_dag(cfg, "ref_logprobs"):
        return skipped
    df, out, v, seconds = model_logprob_table(
        context,
        cfg,
        rollout_store,
        model_store,
        ray,
        table="ref_logprobs",
        model_version=REF_POLICY_VERSION,
        compute=reference_logprobs,
    )
    log_ratio = engine_minus(df, out, "ref_logprobs")  # over the model's own tokens (observation tokens: placeholders)
    return dg.MaterializeResult(
        metadata={
            "delta_version": v,
            "rollouts": len(out),
            "ref_policy_version": REF_POLICY_VERSION,
            "k1_mean": float(log_ratio.mean()) if log_ratio.size else 0.0,
            "ref_s": seconds,
        },
        data_version=data_version("ref_logprobs", v),
    )
