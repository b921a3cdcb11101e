"""RefWorker: the reference policy, loaded once per run, and its per-token log-probs of rollouts.

The math is the trainer's old-log-prob recomputation (stages.train.batching.pad_rollouts +
response_logits, stages.algos.losses.gather_logprobs, micro-batched) at the same temperature, so at
iteration 0 the reference log-probs equal the trainer's old log-probs and the rollout engine's.
"""

from __future__ import annotations

import pandas as pd
import torch

from stages.algos.losses import gather_logprobs
from stages.io.checkpoints import resolve_model_dir
from stages.models.policy import load_policy
from stages.train.actor import compute_logprobs
from stages.train.batching import pad_rollouts, response_logits, to_device
from stages.workers.group import Worker


class RefWorker(Worker):
    """model_dir: the reference checkpoint (policy version ref_policy_version); micro_batch_size rollouts
    per forward; temperature divides the logits (the rollout's sampling temperature, as verl's ref); param_dtype:
    the forward's compute dtype, the actor's (actor.mixed_precision.param_dtype, stages.train.precision);
    max_token_len: with actor.use_dynamic_bsz, actor.log_prob_max_token_len_per_gpu: packed micro-batches of at
    most that many real tokens (stages.train.packing) instead of micro_batch_size padded rollouts."""

    def __init__(
        self,
        rank: int,
        world: int,
        threads: int,
        shape: str = "",
        *,
        model_dir: str,
        ref_policy_version: int,
        micro_batch_size: int = 64,
        temperature: float = 1.0,
        param_dtype: str = "float32",
        max_token_len: int | None = None,
    ) -> None:
        super().__init__(rank, world, threads, shape)
        self.model, tok = load_policy(resolve_model_dir(model_dir))  # a checkpoint reference: fetched to this node
        self.model.to(self.device).eval()
        self.pad_id = tok.pad_token_id
        self.micro_batch_size = micro_batch_size
        self.ref_policy_version = ref_policy_version
        self.temperature = temperature
        self.param_dtype = param_dtype
        self.max_token_len = max_token_len

    def compute_ref_log_prob(self, batch: pd.DataFrame) -> pd.DataFrame:
        """Rows (rollout_id, policy_version, ref_policy_version, ref_logprobs) of the batch's rollouts, in its
        order; ref_logprobs holds one float per response token, observation tokens of a multi-turn response too
        (the consumers leave them out through the response mask)."""
        prompts = [list(map(int, p)) for p in batch["prompt_token_ids"]]
        responses = [list(map(int, r)) for r in batch["response_token_ids"]]
        if self.max_token_len is not None and len(batch):  # packed by the token budget, from one padded batch
            padded = pad_rollouts(prompts, responses, self.pad_id)
            logprobs = compute_logprobs(
                self.model,
                padded,
                self.micro_batch_size,
                self.temperature,
                param_dtype=self.param_dtype,
                max_token_len=self.max_token_len,
            )  # (n, L)
            out = [logprobs[i, : len(r)].tolist() for i, r in enumerate(responses)]
        else:
            out = self._padded_logprobs(prompts, responses)
        return pd.DataFrame(
            {
                "rollout_id": batch["rollout_id"].to_numpy(),
                "policy_version": batch["policy_version"].to_numpy(),
                "ref_policy_version": self.ref_policy_version,
                "ref_logprobs": out,
            }
        )

    @torch.no_grad()
    def _padded_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """Each response's log-probs from padded micro-batches of micro_batch_size rollouts."""
        out: list[list[float]] = []
        for s in range(0, len(prompts), self.micro_batch_size):
            part = slice(s, s + self.micro_batch_size)
            padded = to_device(pad_rollouts(prompts[part], responses[part], self.pad_id), self.device)
            # (n, L, V) float32 logits, the forward at the actor's compute dtype
            logits = response_logits(self.model, padded, self.temperature, param_dtype=self.param_dtype)
            logprobs = gather_logprobs(logits, padded["responses"])  # (n, L)
            out.extend(logprobs[i, : len(r)].tolist() for i, r in enumerate(responses[part]))
        return out
