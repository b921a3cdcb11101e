"""The ref_logprobs asset: the reference policy's log-probs of the rollouts (stages/ref_logprobs.py)."""

import dagster as dg

from assets.stage_assets import StageRun
from stages.ref_logprobs import REF_POLICY_VERSION, mean_log_ratio


def materialize(run: StageRun) -> dg.MaterializeResult:
    """Per-token log-probs of every response under the reference policy (policy version 0), for the KL loss or
    the KL in the reward."""
    results, v, seconds = run.model_pass(REF_POLICY_VERSION)
    return run.result(
        v,
        {
            "rollouts": sum(r.rows for r in results),
            "ref_policy_version": REF_POLICY_VERSION,
            "k1_mean": mean_log_ratio(results),  # over the model's own tokens (observation tokens: placeholders)
            "ref_s": seconds,
        },
    )
