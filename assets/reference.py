"""Reference-policy log-probs of each iteration's rollouts (KL loss / KL in reward)."""

import dagster as dg

from assets.common import ROLLOUT, asset_deps, data_version, model_logprob_table, outside_dag, run_iterations
from assets.resources import ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource
from stages.ref_logprobs import REF_POLICY_VERSION, mean_log_ratio, reference_logprobs


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
    results, v, seconds = model_logprob_table(
        context,
        cfg,
        rollout_store,
        model_store,
        ray,
        table="ref_logprobs",
        model_version=REF_POLICY_VERSION,
        compute=reference_logprobs,
    )
    return dg.MaterializeResult(
        metadata={
            "delta_version": v,
            "rollouts": sum(r.rows for r in results),
            "ref_policy_version": REF_POLICY_VERSION,
            "k1_mean": mean_log_ratio(results),  # over the model's own tokens (observation tokens: placeholders)
            "ref_s": seconds,
        },
        data_version=data_version("ref_logprobs", v),
    )
