"""HF engine: valid tokens, logprobs equal to the trainer's recomputation, finish reasons, weight reload."""

from __future__ import annotations

import pytest
import torch

from stages.algos.losses import gather_logprobs
from stages.models.engines.base import SamplingSpec
from stages.models.engines.hf_engine import HFEngine, sampled_logprobs
from stages.models.policy import encode_chat, load_policy, save_policy
from stages.train.batching import pad_rollouts, response_logits


def _prompts(tok, texts):
    return [encode_chat(tok, [{"role": "user", "content": t}])[0] for t in texts]


def test_generate_returns_tokens_logprobs_and_finish_reason(tiny_checkpoint) -> None:
    eng = HFEngine(str(tiny_checkpoint))
    prompts = _prompts(eng.tokenizer, ["1+2=", "13+4="])
    out = eng.generate(prompts, SamplingSpec(n=3, max_tokens=6, seed=0))
    assert [len(g) for g in out] == [3, 3]
    vocab = len(eng.tokenizer)
    for gens in out:
        for g in gens:
            assert 1 <= len(g.token_ids) <= 6 and len(g.logprobs) == len(g.token_ids)
            assert all(0 <= t < vocab for t in g.token_ids) and all(lp <= 0 for lp in g.logprobs)
            stopped = g.token_ids[-1] == eng.tokenizer.eos_token_id
            assert g.finish_reason == ("stop" if stopped else "length")
            assert eng.tokenizer.pad_token_id not in g.token_ids


def test_sampling_logprobs_match_trainer_recomputation(tiny_checkpoint) -> None:
    """At temperature 1, no top-k/top-p, the engine's logprobs are the policy's (up to pad suppression)."""
    eng = HFEngine(str(tiny_checkpoint))
    prompts = _prompts(eng.tokenizer, ["7+8=", "2+2=", "19+0="])
    gens = [g for gs in eng.generate(prompts, SamplingSpec(n=4, max_tokens=8, seed=1)) for g in gs]
    model, tok = load_policy(tiny_checkpoint)
    batch = pad_rollouts([p for p in prompts for _ in range(4)], [g.token_ids for g in gens], tok.pad_token_id)
    with torch.no_grad():
        logits = response_logits(model, batch)
        logits[..., tok.pad_token_id] = float("-inf")  # the engine suppresses pad
        lp = gather_logprobs(logits, batch["responses"])
    diffs = [abs(lp[i, j].item() - g.logprobs[j]) for i, g in enumerate(gens) for j in range(len(g.token_ids))]
    assert max(diffs) < 1e-4, f"max |engine - trainer| logprob = {max(diffs):.2e}"


def test_greedy_is_deterministic_and_reload_changes_outputs(tiny_checkpoint, tmp_path) -> None:
    eng = HFEngine(str(tiny_checkpoint))
    prompts = _prompts(eng.tokenizer, ["3+3=", "10+5="])
    greedy = SamplingSpec(n=1, max_tokens=6, greedy=True)
    before = [g[0].token_ids for g in eng.generate(prompts, greedy)]
    assert before == [g[0].token_ids for g in eng.generate(prompts, greedy)]
    model, tok = load_policy(tiny_checkpoint)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # large noise on every weight: a visibly different policy
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    save_policy(model, tok, tmp_path / "v1")
    eng.load_checkpoint(str(tmp_path / "v1"))
    after = [g[0].token_ids for g in eng.generate(prompts, greedy)]
    fresh = HFEngine(str(tmp_path / "v1"))
    assert after == [g[0].token_ids for g in fresh.generate(prompts, greedy)] and after != before


@pytest.mark.parametrize(
    ("batch", "vocab", "steps"), [(5, 37, 12), (3, 37, 100), (2, 49152, 97), (2, 49152, 130), (2, 50, 1)]
)
def test_sampled_logprobs_equal_compute_transition_scores_bit_for_bit(tiny_checkpoint, batch, vocab, steps) -> None:
    """The blocked log-softmax gives exactly HF's compute_transition_scores(normalize_logits=True), masked
    (-inf) vocabulary entries included, whatever the number of steps (tiny_cpu's rollout_logprobs and every
    metric computed from them stay bit-identical)."""
    gen = torch.Generator().manual_seed(steps)
    scores = tuple(torch.randn(batch, vocab, generator=gen) * 4 for _ in range(steps))
    for s in scores:
        s[:, 1] = float("-inf")  # a suppressed token (pad), as SuppressTokensLogitsProcessor leaves it
    tokens = torch.randint(2, vocab, (batch, steps), generator=gen)
    model, _ = load_policy(tiny_checkpoint)
    model.config.vocab_size = vocab  # compute_transition_scores reshapes by the config's vocabulary size
    want = model.compute_transition_scores(tokens, scores, normalize_logits=True)
    assert torch.equal(sampled_logprobs(scores, tokens), want)
