"""Rollout stage: prompts -> n sampled responses each, on a Ray Data actor pool.

The engine (HF or vLLM) is built once per actor in `__init__`, never per batch. Each output row
is one rollout with its prompt and response token ids, per-token logprobs and finish reason.
"""
from __future__ import annotations

import time

import pandas as pd

from stages.engines import SamplingSpec, build_engine, resolve_engine_name
from stages.models import encode_chat
from stages.ray_data import map_with_actor_pool


def tokenize_prompts(messages: list[list[dict]], tokenizer, max_prompt_length: int,
                     prompt_ids: list[int] | None = None) -> tuple[list[list[int]], list[str]]:
    """Chat-template and tokenize prompts; a prompt over the limit is a clear error."""
    ids, texts = [], []
    for i, msgs in enumerate(messages):
        toks, text = encode_chat(tokenizer, msgs)
        if len(toks) > max_prompt_length:
            which = prompt_ids[i] if prompt_ids is not None else i
            raise ValueError(f"prompt {which} has {len(toks)} tokens, over data.max_prompt_length "
                             f"({max_prompt_length}); raise the limit or filter long prompts: {text[:80]!r}...")
        ids.append(list(toks))
        texts.append(text)
    return ids, texts


def sampling_from_config(rollout_cfg, max_tokens: int, *, seed: int, greedy: bool = False,
                         n: int | None = None) -> SamplingSpec:
    return SamplingSpec(temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
                        max_tokens=max_tokens, n=n if n is not None else rollout_cfg.n, seed=seed,
                        stop=tuple(rollout_cfg.stop), greedy=greedy)


class RolloutStage:
    """ds.map_batches(RolloutStage, fn_constructor_kwargs={...}, concurrency=k)."""

    def __init__(self, model_dir: str, engine: str, sampling: dict, micro_batch_size: int = 256,
                 num_threads: int | None = None) -> None:
        t0 = time.perf_counter()
        self.engine_name = resolve_engine_name(engine)
        # vLLM's CPU attention sizes its thread pool from the OpenMP runtime Ray started with;
        # changing torch's thread count afterwards makes it abort, so only HF gets num_threads
        threads = num_threads if self.engine_name == "hf" else None
        self.engine = build_engine(self.engine_name, model_dir, micro_batch_size=micro_batch_size,
                                   num_threads=threads)
        self.sampling = SamplingSpec(**{**sampling, "stop": tuple(sampling.get("stop", ()))})
        self.build_s = time.perf_counter() - t0

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        t0 = time.perf_counter()
        seed = None if self.sampling.seed is None else self.sampling.seed * 1_000_003 + int(batch["prompt_id"].min())
        spec = SamplingSpec(**{**self.sampling.__dict__, "seed": seed})
        prompts = [list(map(int, p)) for p in batch["prompt_token_ids"]]
        outs = self.engine.generate(prompts, spec)
        rows = []
        for (_, prow), gens in zip(batch.iterrows(), outs):
            for k, g in enumerate(gens):
                rows.append({**prow.to_dict(), "sample_index": k, "response_token_ids": g.token_ids,
                             "rollout_logprobs": g.logprobs, "response_text": g.text,
                             "response_length": len(g.token_ids), "finish_reason": g.finish_reason,
                             "engine": self.engine.name})
        out = pd.DataFrame(rows)
        out["generate_s"] = time.perf_counter() - t0
        out["engine_build_s"] = self.build_s
        return out


def generate_rollouts(prompt_batch: pd.DataFrame, *, model_dir: str, rollout_cfg, max_tokens: int, seed: int,
                      greedy: bool = False, n: int | None = None, use_ray: bool = True) -> pd.DataFrame:
    """Run the rollout stage over prompt_batch (prompt_id, prompt_token_ids, ...), sorted output.

    Returns one row per (prompt, sample) with rollout_id = position in (prompt_id, sample_index) order.
    """
    spec = sampling_from_config(rollout_cfg, max_tokens, seed=seed, greedy=greedy, n=n)
    kwargs = {"model_dir": model_dir, "engine": rollout_cfg.name, "sampling": spec.__dict__,
              "micro_batch_size": rollout_cfg.micro_batch_size}
    if use_ray:
        workers = max(1, min(rollout_cfg.num_workers, len(prompt_batch)))
        out = map_with_actor_pool(prompt_batch, RolloutStage, {**kwargs, "num_threads": 2 if workers == 1 else 1},
                                  workers=workers)
    else:
        out = RolloutStage(**kwargs)(prompt_batch)
    out = out.sort_values(["prompt_id", "sample_index"]).reset_index(drop=True)
    out["rollout_id"] = range(len(out))
    return out
