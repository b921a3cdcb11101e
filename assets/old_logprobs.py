"""The actor's recomputed log-probs of each iteration's rollouts (verl's compute_log_prob -> old_log_prob)."""

import dagster as dg

from assets.common import TRAIN, iterations, model_logprob_table
from assets.resources import ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource
from stages.dag import upstream
from stages.old_logprobs import policy_old_logprobs, probs_gap


@dg.asset(partitions_def=iterations, group_name=TRAIN, kinds={"ray", "pytorch", "delta"}, deps=upstream("old_logprobs"))
def old_logprobs(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    rollout_store: RolloutStoreResource,
    model_store: ModelStoreResource,
    ray: RayResource,
) -> dg.MaterializeResult:
    """Per-token log-probs of every response under the policy that sampled it (version == iteration), on the
    actor workers, which keep that policy resident for the update; and their gap to the engine's."""
    cfg, it = run_config.load(), int(context.partition_key)
    df, out, v, seconds = model_logprob_table(
        context,
        cfg,
        rollout_store,
        model_store,
        ray,
        table="old_logprobs",
        model_version=it,
        compute=policy_old_logprobs,
    )
    engine = df.set_index("rollout_id").loc[out["rollout_id"], "rollout_logprobs"].tolist()
    gap, _, _ = probs_gap(out["old_logprobs"].tolist(), engine)  # over every rollout (ReMax baselines too)
    return dg.MaterializeResult(
        metadata={"delta_version": v, "rollouts": len(out), "policy_version": it, "old_s": seconds, **gap}
    )
