"""Rollout stage: prompts -> n sampled responses each, on the run's persistent engine hosts.

The engine (HF or vLLM) is built once per worker and kept for the whole run: after a policy
update it takes the new weights in place (`RolloutEngine.load_checkpoint`) instead of being
rebuilt. Each output row is one rollout with its prompt and response token ids, per-token
logprobs and finish reason.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from stages.models.engines import SamplingSpec, build_engine, resolve_engine_name
from stages.filter_groups import generate_until_full
from stages.reward import score_rollouts
from stages.workers.tasks import split_frame
from stages import seeds


def sampling_from_config(rollout_cfg, max_tokens: int, *, seed: int, greedy: bool = False,
                         n: int | None = None) -> SamplingSpec:
    return SamplingSpec(temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
                        max_tokens=max_tokens, n=n if n is not None else rollout_cfg.n, seed=seed,
                        stop=tuple(rollout_cfg.stop), greedy=greedy)


class RolloutStage:
    """Hosts one engine for the whole run and keeps its weights current.

    `sync(model_dir)` is free when the engine already holds that checkpoint, loads the weights in
    place when only the weights changed (vLLM: reload_weights + prefix-cache reset), and builds
    a new engine when the architecture, engine or batch size changed. `last_sync` says which.
    """

    def __init__(self, engine: str, micro_batch_size: int = 256, num_threads: int | None = None) -> None:
        self.engine_name = resolve_engine_name(engine)
        # vLLM's CPU attention sizes its thread pool from the OpenMP runtime the process started
        # with (the worker's OMP_NUM_THREADS); changing torch's thread count afterwards makes it
        # abort, so only HF gets num_threads
        self.num_threads = num_threads if self.engine_name == "hf" else None
        self.micro_batch_size = micro_batch_size
        self.engine = None
        self.loaded: tuple | None = None
        self.last_sync, self.last_sync_s = "none", 0.0

    def sync(self, model_dir: str) -> str:
        t0 = time.perf_counter()
        ident = checkpoint_identity(model_dir)
        if self.engine is not None and ident == self.loaded:
            self.last_sync = "cached"
        elif self.engine is not None and self.loaded is not None and ident[2] == self.loaded[2]:
            self.engine.load_checkpoint(model_dir)
            self.last_sync = "in_place"
        else:
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()
            self.engine = build_engine(self.engine_name, model_dir, micro_batch_size=self.micro_batch_size,
                                       num_threads=self.num_threads)
            self.last_sync = "build"
        self.loaded, self.last_sync_s = ident, time.perf_counter() - t0
        return self.last_sync

    def generate(self, batch: pd.DataFrame, sampling: SamplingSpec) -> pd.DataFrame:
        """One row per (prompt row, sample) with token ids, logprobs, finish reason and timings."""
        t0 = time.perf_counter()
        seed = None if sampling.seed is None else seeds.engine_shard(sampling.seed, int(batch["prompt_id"].min()))
        spec = SamplingSpec(**{**sampling.__dict__, "seed": seed})
        outs = self.engine.generate([list(map(int, p)) for p in batch["prompt_token_ids"]], spec)
        rows = []
        for (_, prow), gens in zip(batch.iterrows(), outs):
            for k, g in enumerate(gens):
                rows.append({**prow.to_dict(), "sample_index": k, "response_token_ids": g.token_ids,
                             "rollout_logprobs": g.logprobs, "response_text": g.text,
                             "response_length": len(g.token_ids), "finish_reason": g.finish_reason,
                             "engine": self.engine.name})
        out = pd.DataFrame(rows)
        out["generate_s"] = time.perf_counter() - t0
        out["engine_sync"] = self.last_sync
        out["engine_sync_s"] = self.last_sync_s
        return out


def checkpoint_identity(model_dir: str) -> tuple[str, str, str]:
    """(resolved dir, checkpoint id or weights mtime, config.json text): what an engine holds."""
    from stages.update import checkpoint_id

    path = Path(model_dir).resolve()
    cfg = (path / "config.json").read_text()
    ident = checkpoint_id(path) or ":".join(f"{f.name}@{f.stat().st_mtime_ns}" for f in sorted(path.glob("*.safetensors")))
    return str(path), ident, cfg


_HOST: dict[tuple, RolloutStage] = {}
"""The engine host of this process (a persistent rollout worker, or the driver for use_ray=False)."""


def host_generate(model_dir: str, engine: str, micro_batch_size: int, num_threads: int | None,
                  batch: pd.DataFrame, sampling: SamplingSpec) -> pd.DataFrame:
    """Generate with this process's engine host (built on first use, synced to model_dir)."""
    key = (resolve_engine_name(engine), micro_batch_size, num_threads)
    if key not in _HOST:
        for old in _HOST.values():  # one engine per process: free the previous one first
            close = getattr(old.engine, "close", None)
            if close is not None:
                close()
        _HOST.clear()
        _HOST[key] = RolloutStage(engine, micro_batch_size, num_threads)
    host = _HOST[key]
    host.sync(model_dir)
    return host.generate(batch, sampling)


def generate_rollouts(prompt_batch: pd.DataFrame, *, model_dir: str, rollout_cfg, max_tokens: int, seed: int,
                      greedy: bool = False, n: int | None = None, use_ray: bool = True) -> pd.DataFrame:
    """Run the rollout stage over prompt_batch (prompt_id, prompt_token_ids, ...), sorted output.

    With use_ray, the batch is split into contiguous shards over the run's rollout.num_workers
    persistent engine hosts (Ray actors that keep their engine across iterations); else the driver
    hosts the engine. Returns one row per (prompt, sample) with rollout_id = position in
    (prompt_id, sample_index) order.
    """
    spec = sampling_from_config(rollout_cfg, max_tokens, seed=seed, greedy=greedy, n=n)
    workers = rollout_cfg.num_workers
    threads = 2 if workers == 1 else 1
    args = (model_dir, rollout_cfg.name, rollout_cfg.micro_batch_size, threads)
    if use_ray:
        from stages.workers.group import run_with_retry

        shards = split_frame(prompt_batch, min(workers, len(prompt_batch)))
        calls = [("stages.rollout:host_generate", *args, shard, spec) for shard in shards]
        parts = run_with_retry("rollout", workers, lambda g: g.map("call", calls), threads=threads,
                               process_group=False)
        out = pd.concat(parts, ignore_index=True)
    else:
        out = host_generate(*args, prompt_batch, spec)
    out = out.sort_values(["prompt_id", "sample_index"]).reset_index(drop=True)
    out["rollout_id"] = range(len(out))
    return out


def add_greedy_baselines(sampled: pd.DataFrame, prompts: pd.DataFrame,
                         generate_greedy: Callable[[pd.DataFrame], pd.DataFrame]) -> pd.DataFrame:
    """`sampled` plus one greedy response per group it holds (ReMax), marked is_baseline with sample_index -1
    and rollout_ids after the sampled ones (unique in the iteration); sampled rows get is_baseline False.

    prompts: the prompt rows (one per group_id, as in the prompt batch); generate_greedy(prompts) -> one
    rollout per prompt row, carrying its group_id."""
    groups = prompts[prompts["group_id"].isin(set(sampled["group_id"]))].reset_index(drop=True)
    greedy = generate_greedy(groups)
    if len(greedy) != len(groups) or set(greedy["group_id"]) != set(groups["group_id"]):
        raise ValueError(f"the greedy baseline pass returned {len(greedy)} rollouts for {len(groups)} prompts; "
                         "ReMax needs exactly one per prompt (generate with n=1)")
    start = int(sampled["rollout_id"].max()) + 1
    greedy = greedy.assign(sample_index=-1, is_baseline=True, rollout_id=np.arange(start, start + len(greedy)))
    return pd.concat([sampled.assign(is_baseline=False), greedy], ignore_index=True)

def sample_rollouts(batch: pd.DataFrame, *, model_dir: str, cfg, iteration: int) -> pd.DataFrame:
    """The iteration's rollouts: one generation of the batch, or DAPO rounds until the batch is full; with
    adv_estimator='remax' plus one greedy baseline row per generated prompt (add_greedy_baselines).
    batch: a prompt_batches partition with group_id and policy_version set."""
    def generate(prompts: pd.DataFrame, r: int) -> pd.DataFrame:
        return generate_rollouts(prompts, model_dir=model_dir, rollout_cfg=cfg.rollout,
                                 max_tokens=cfg.data.max_response_length, seed=seeds.rollout(cfg.rollout.seed, iteration, r))

    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        out = generate(batch, 0).assign(gen_round=0)
    else:
        out = generate_until_full(
            batch, generate, lambda out: score_rollouts(out, cfg.reward, use_ray=False,
                                                        max_response_length=cfg.data.max_response_length),
            metric=fg.metric, correct_score=cfg.reward.score, need_groups=cfg.data.train_batch_size)
    if cfg.algorithm.adv_estimator != "remax":
        return out
    return add_greedy_baselines(out, batch, lambda prompts: generate_rollouts(
        prompts, model_dir=model_dir, rollout_cfg=cfg.rollout, max_tokens=cfg.data.max_response_length,
        seed=seeds.rollout(cfg.rollout.seed, iteration), greedy=True, n=1))
