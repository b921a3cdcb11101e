"""Reference-policy log-prob stage: per-token log-probs of every rollout's response under the
reference policy (policy version 0 of the run), for KL as a loss (actor.use_kl_loss) or in the
reward (algorithm.use_kl_in_reward).

The math is the trainer's old-log-prob recomputation (stages.train.batching.pad_rollouts +
response_logits, stages.algos.losses.gather_logprobs, micro-batched) at the same temperature (the
rollout's sampling temperature, as verl's ref), so at iteration 0 the reference log-probs equal the
trainer's old log-probs and the rollout engine's (a test checks 1e-4). The model loads once per
Ray Data actor, never per batch.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from stages.algos.losses import gather_logprobs
from stages.train.batching import pad_rollouts, response_logits
from stages.workers.tasks import map_with_actor_pool

REF_POLICY_VERSION = 0
"""verl's reference policy is the initial actor; in rlake that is policy version 0 of the run."""


class RefLogprobStage:
    """ds.map_batches(RefLogprobStage, fn_constructor_kwargs={"model_dir": ...}) or called directly."""

    def __init__(self, model_dir: str, micro_batch_size: int = 64, num_threads: int | None = None,
                 ref_policy_version: int = REF_POLICY_VERSION, temperature: float = 1.0) -> None:
        from stages.models.policy import load_policy

        if num_threads:
            torch.set_num_threads(num_threads)
        self.model, tok = load_policy(model_dir)
        self.model.eval()
        self.pad_id = tok.pad_token_id
        self.micro_batch_size = micro_batch_size
        self.ref_policy_version = ref_policy_version
        self.temperature = temperature

    @torch.no_grad()
    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        out: list[list[float]] = []
        for s in range(0, len(batch), self.micro_batch_size):
            part = batch.iloc[s:s + self.micro_batch_size]
            prompts = [list(map(int, p)) for p in part["prompt_token_ids"]]
            responses = [list(map(int, r)) for r in part["response_token_ids"]]
            padded = pad_rollouts(prompts, responses, self.pad_id)
            logits = response_logits(self.model, padded, self.temperature)  # (n, L, V)
            logprobs = gather_logprobs(logits, padded["responses"])  # (n, L)
            out.extend(logprobs[i, :len(r)].tolist() for i, r in enumerate(responses))
        return pd.DataFrame({"rollout_id": batch["rollout_id"].to_numpy(),
                             "policy_version": batch["policy_version"].to_numpy(),
                             "ref_policy_version": self.ref_policy_version, "ref_logprobs": out})


def compute_ref_logprobs(rollouts: pd.DataFrame, *, model_dir: str, micro_batch_size: int = 64,
                         num_workers: int = 1, use_ray: bool = True, temperature: float = 1.0) -> pd.DataFrame:
    """Rows of the ref_logprobs table (rollout_id, policy_version, ref_policy_version, ref_logprobs),
    sorted by rollout_id; one list per rollout, as long as its response."""
    if not len(rollouts):
        raise ValueError("compute_ref_logprobs got no rollouts: the rollouts partition is empty")
    kwargs = {"model_dir": model_dir, "micro_batch_size": micro_batch_size, "temperature": temperature}
    if use_ray:
        workers = max(1, min(num_workers, len(rollouts)))
        out = map_with_actor_pool(rollouts, RefLogprobStage, {**kwargs, "num_threads": 2 if workers == 1 else 1},
                                  workers=workers)
    else:
        out = RefLogprobStage(**kwargs)(rollouts)
    out = out.sort_values("rollout_id").reset_index(drop=True)
    lengths = rollouts.set_index("rollout_id").loc[out["rollout_id"], "response_length"].to_numpy()
    assert (out["ref_logprobs"].map(len).to_numpy() == np.asarray(lengths)).all(), "ref log-probs / response lengths differ"
    return out


def needs_ref_logprobs(cfg) -> bool:
    """Whether the run uses the reference policy: KL as a loss or in the reward."""
    return bool(cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)
