"""Reference-policy log-probs of each iteration's rollouts (KL loss / KL in reward)."""

import dagster as dg
import numpy as np

from assets.common import ROLLOUT, asset_deps, data_version, model_logprob_table, outside_dag, run_iterations
from assets.resources import ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource
from stages.old_logprobs import engine_logprobs_and_masks
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
    engine, masks = engine_logprobs_and_masks(df, out["rollout_id"])
    log_ratio = np.concatenate(  # over the model's tokens (observation tokens' rollout_logprobs are placeholders)
        [
            (np.asarray(a) - np.asarray(b))[np.ones(len(a), bool) if m is None else np.asarray(m, bool)]
            for a, b, m in zip(engine, out["ref_logprobs"], masks or [None] * len(engine), strict=True)
        ]
        or [np.zeros(0)]
    )
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
