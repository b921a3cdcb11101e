"""RolloutWorker: one rollout engine (HF or vLLM), kept for the whole run, synced to each policy version.

stages.rollout shards a prompt batch over the "rollout" group and calls `RolloutWorker.generate` on
each rank (verl: `generate_sequences`); with use_ray=False the caller holds a RolloutWorker in its
own process. After a policy update the engine takes the new weights in place instead of being
rebuilt (see `sync`).
"""

from __future__ import annotations

import time

import pandas as pd

from stages import seeds
from stages.io.checkpoints import checkpoint_identity
from stages.models.engines import RolloutEngine, SamplingSpec, build_engine, resolve_engine_name
from stages.workers.group import Worker


class RolloutWorker(Worker):
    """Holds one engine and the identity of the checkpoint it holds (`loaded`).

    engine: rollout.name ('auto' resolves to 'vllm' when installed, else 'hf'); micro_batch_size:
    rollout.micro_batch_size, prompts per engine call."""

    def __init__(
        self, rank: int, world: int, threads: int, shape: str = "", *, engine: str = "auto", micro_batch_size: int = 256
    ) -> None:
        super().__init__(rank, world, threads, shape)
        self.engine_name = resolve_engine_name(engine)
        # vLLM's CPU attention sizes its thread pool from the OpenMP runtime the process started
        # with (the worker's OMP_NUM_THREADS); changing torch's thread count afterwards makes it
        # abort, so only HF gets num_threads
        self.num_threads = threads if self.engine_name == "hf" else None
        self.micro_batch_size = micro_batch_size
        self.engine: RolloutEngine | None = None
        self.loaded: tuple[str, str, str] | None = None
        self.last_sync, self.last_sync_s = "none", 0.0

    def sync(self, model_dir: str) -> str:
        """Make the engine hold model_dir: "cached" when it already does, "in_place" when only the weights
        changed (vLLM: reload_weights + prefix-cache reset), "build" when the architecture changed or no
        engine exists yet. Returns (and records in last_sync) which one happened."""
        t0 = time.perf_counter()
        ident = checkpoint_identity(model_dir)
        if self.engine is not None and ident == self.loaded:
            self.last_sync = "cached"
        elif self.engine is not None and self.loaded is not None and ident[2] == self.loaded[2]:
            self.engine.load_checkpoint(model_dir)
            self.last_sync = "in_place"
        else:
            self.close()
            self.engine = build_engine(
                self.engine_name, model_dir, micro_batch_size=self.micro_batch_size, num_threads=self.num_threads
            )
            self.last_sync = "build"
        self.loaded, self.last_sync_s = ident, time.perf_counter() - t0
        return self.last_sync

    def generate(self, model_dir: str, batch: pd.DataFrame, sampling: SamplingSpec) -> pd.DataFrame:
        """Sync to model_dir, then one row per (prompt row, sample) with token ids, logprobs, finish reason,
        timings and how the engine was synced. Sampling is seeded by the shard's first prompt_id, so the
        same prompts get the same seed whatever the sharding."""
        self.sync(model_dir)
        t0 = time.perf_counter()
        seed = None if sampling.seed is None else seeds.engine_shard(sampling.seed, int(batch["prompt_id"].min()))
        spec = SamplingSpec(**{**sampling.__dict__, "seed": seed})
        outs = self.engine.generate([list(map(int, p)) for p in batch["prompt_token_ids"]], spec)
        rows = []
        for (_, prow), gens in zip(batch.iterrows(), outs, strict=True):
            for k, g in enumerate(gens):
                rows.append(
                    {
                        **prow.to_dict(),
                        "sample_index": k,
                        "response_token_ids": g.token_ids,
                        "rollout_logprobs": g.logprobs,
                        "response_text": g.text,
                        "response_length": len(g.token_ids),
                        "finish_reason": g.finish_reason,
                        "engine": self.engine.name,
                    }
                )
        out = pd.DataFrame(rows)
        out["generate_s"] = time.perf_counter() - t0
        out["engine_sync"] = self.last_sync
        out["engine_sync_s"] = self.last_sync_s
        return out

    def close(self) -> None:
        """Free the engine (vLLM holds memory and threads until closed)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        self.engine, self.loaded = None, None
