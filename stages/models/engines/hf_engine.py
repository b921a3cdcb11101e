"""HF transformers generation engine: batched `generate` with left padding.

Per-token logprobs are those of the sampling distribution (after temperature / top-k / top-p): the
values `compute_transition_scores(..., normalize_logits=True)` gives, bit for bit, computed in blocks of
steps (`sampled_logprobs`); the trainer recomputes its own old_logprobs before the update, as verl does, so
PPO ratios never depend on engine numerics.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from stages.models.engines.base import Generation, RolloutEngine, SamplingSpec
from stages.models.fingerprint import fingerprint_state
from stages.models.policy import load_policy

LOGPROB_BLOCK = 16
"""Generation steps per log-softmax in sampled_logprobs. PyTorch's CPU log-softmax over a non-last dimension
computes full vectors of steps (16 floats on AVX-512, 8 on AVX2) in vector code and a last partial vector in
scalar code, which rounds differently; blocks of a multiple of the vector width starting at step 0 put every
step in the same kind of lane as one log-softmax over all the steps does."""


def sampled_logprobs(scores: tuple[torch.Tensor, ...], tokens: torch.Tensor) -> torch.Tensor:
    """(batch, steps) log-prob of each generated token under the processed scores it was sampled from: the
    values of `compute_transition_scores(sequences, scores, normalize_logits=True)`, bit for bit on CPU
    (tests/stages/test_hf_engine.py) and within 9.5e-7 on an H200 (bench/device/check_sampled_logprobs.py;
    CUDA's log-softmax of a 16-step block reduces in another order), without the copy of every step's scores
    into one (batch, vocab, steps) tensor it makes, the slowest part of a rollout's logprobs on a large
    vocabulary (1.4-2.7x less time on SmolLM2's 49k, measured on a loaded 2-core CPU). scores: generate's
    per-step (batch, vocab) processed scores; tokens: the (batch, steps) tokens generated."""
    out = []
    for start in range(0, len(scores), LOGPROB_BLOCK):
        block = torch.stack(scores[start : start + LOGPROB_BLOCK], dim=-1)  # (batch, vocab, steps), as HF lays it
        index = tokens[:, start : start + block.shape[-1]].unsqueeze(1)
        out.append(torch.log_softmax(block, dim=1).gather(1, index).squeeze(1))
    return torch.cat(out, dim=1) if out else tokens.new_zeros((tokens.shape[0], 0), dtype=torch.float32)


class HFEngine(RolloutEngine):
    name = "hf"

    def __init__(
        self,
        model_dir: str,
        *,
        micro_batch_size: int = 256,
        dtype: str = "float32",
        num_threads: int | None = None,
        device: str = "cpu",
    ) -> None:
        """device: where the model and every batch live (the RolloutWorker's: cuda:0 on a GPU run)."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.dtype = dtype
        self.micro_batch_size = micro_batch_size
        self.device = torch.device(device)
        self.model, self.tokenizer = load_policy(model_dir, dtype)
        self.model.to(self.device).eval()
        self._fingerprint = fingerprint_state(self.model.named_parameters())

    def load_checkpoint(self, model_dir: str) -> None:
        state = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            state.update(load_file(str(f)))
        self.load_state(state, source=f"checkpoint {model_dir}")

    def load_state(self, state: dict, *, source: str = "the published weights") -> None:
        """New weights in place from a state dict (HF names; CPU tensors, e.g. from Ray's object store)."""
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(
                f"{source} does not match the engine's model: "
                f"missing={sorted(set(missing) - tied)} unexpected={sorted(unexpected)}"
            )
        self._fingerprint = fingerprint_state(self.model.named_parameters())

    def weights_fingerprint(self, *, refresh: bool = False) -> str:
        if refresh:
            self._fingerprint = fingerprint_state(self.model.named_parameters())
        return self._fingerprint

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Generation]]:
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        expanded = [p for p in prompt_token_ids for _ in range(sampling.n)]
        flat: list[Generation] = []
        for start in range(0, len(expanded), self.micro_batch_size):
            flat.extend(self._generate_batch(expanded[start : start + self.micro_batch_size], sampling))
        return [flat[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompt_token_ids))]

    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingSpec) -> list[Generation]:
        tok = self.tokenizer
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        kwargs: dict = dict(
            max_new_tokens=sampling.max_tokens,
            return_dict_in_generate=True,
            output_scores=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        if tok.pad_token_id != tok.eos_token_id:  # pad only fills finished rows, never sampled
            kwargs["suppress_tokens"] = [tok.pad_token_id]
        if sampling.greedy or sampling.temperature == 0:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else 0,
            )
        if sampling.stop:
            kwargs.update(stop_strings=list(sampling.stop), tokenizer=tok)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), **kwargs)
        seqs = out.sequences[:, width:]  # (n, L')
        scores = sampled_logprobs(out.scores, seqs)
        results = []
        for row, lp in zip(seqs.tolist(), scores.tolist()):
            n_tok = len(row)
            finish = "length"
            if tok.eos_token_id in row:
                n_tok = row.index(tok.eos_token_id) + 1
                finish = "stop"
            token_ids = row[:n_tok]
            text = tok.decode(token_ids, skip_special_tokens=True)
            if finish == "length" and sampling.stop and any(text.endswith(s) for s in sampling.stop):
                finish = "stop"
            results.append(
                Generation(
                    token_ids=token_ids, logprobs=[float(x) for x in lp[:n_tok]], finish_reason=finish, text=text
                )
            )
        return results
