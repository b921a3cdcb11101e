"""RolloutWorker: one rollout engine (HF or vLLM), kept for the whole run, synced to each policy version.

stages.rollouts shards a prompt batch over the "rollout" group and calls `RolloutWorker.generate` on
each rank (verl: `generate_sequences`); with use_ray=False the caller holds a RolloutWorker in its
own process. After a policy update the engine takes the new weights in place instead of being
rebuilt (see `sync`).

On a GPU (the worker's device is CUDA: trainer.n_gpus_per_node > 0) the engine shares the GPU with the
trainer ranks (verl's hybrid engine): vLLM takes rollout.gpu_memory_utilization of its memory and is built
with sleep mode, so after each generate call it sleeps (level 1: KV cache freed, weights offloaded to
host memory) and wakes before the next sync, leaving the GPU to the old-log-prob and update stages. The
weights still reach the engine from the checkpoint on disk (the fallback path verl keeps too); the HF
engine runs on the worker's device. On the CPU nothing of this applies.

The model_dir a worker is handed is a checkpoint reference (stages.io.checkpoints.checkpoint_ref: a committed
checkpoint in storage, fetched into this node's cache) or a local directory; the engine's identity is the
checkpoint id, so a cached copy on any node is the same engine state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pandas as pd
import ray

from stages import seeds
from stages.io.checkpoints import checkpoint_id, checkpoint_identity, ref_checkpoint_id, resolve_model_dir
from stages.models.engines import RolloutEngine, SamplingSpec, build_engine, resolve_engine_name
from stages.models.policy import load_tokenizer
from stages.tools import load_tools, run_agent_loop
from stages.workers.group import Worker


class RolloutWorker(Worker):
    """Holds one engine and the identity of the checkpoint it holds (`loaded`).

    engine: rollout.name ('auto' resolves to 'vllm' when installed, else 'hf'); micro_batch_size:
    rollout.micro_batch_size, prompts per engine call."""

    def __init__(
        self,
        rank: int,
        world: int,
        threads: int,
        shape: str = "",
        *,
        engine: str = "auto",
        micro_batch_size: int = 256,
        gpu_memory_utilization: float = 0.5,
    ) -> None:
        super().__init__(rank, world, threads, shape)
        self.engine_name = resolve_engine_name(engine)
        # vLLM's CPU attention sizes its thread pool from the OpenMP runtime the process started
        # with (the worker's OMP_NUM_THREADS); changing torch's thread count afterwards makes it
        # abort, so only HF gets num_threads
        self.num_threads = threads if self.engine_name == "hf" else None
        self.micro_batch_size = micro_batch_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.engine: RolloutEngine | None = None
        self.loaded: tuple[str, str] | None = None
        """(checkpoint identity, config.json text) of what the engine holds (checkpoint_identity)."""
        self.last_sync, self.last_sync_s = "none", 0.0
        self.tokenizer = None  # (checkpoint identity, tokenizer): multi-turn rollouts encode observations
        self.tools = None  # (tool_config_path, name -> Tool): multi-turn rollouts

    def sync(self, model_dir: str, weights: Sequence = ()) -> str:
        """Make the engine hold model_dir: "cached" when it already does, "object_store" when its weights came
        from Ray's object store (`weights`: [ref] published by the trainer, rollout.weight_sync=object_store; the
        HF engine), "in_place" when only the weights changed (vLLM: reload_weights + prefix-cache reset), "build"
        when the architecture changed or no engine exists yet. Returns (and records in last_sync) which one."""
        t0 = time.perf_counter()
        if weights and self._sync_from_object_store(model_dir, weights[0]):
            self.last_sync_s = time.perf_counter() - t0
            return self.last_sync
        model_dir = str(resolve_model_dir(model_dir))  # a checkpoint reference: this node's cached copy
        ident = checkpoint_identity(model_dir)
        if self.engine is not None and ident == self.loaded:
            self.last_sync = "cached"
        elif self.engine is not None and self.loaded is not None and ident[1] == self.loaded[1]:
            self.engine.load_checkpoint(model_dir)
            self.last_sync = "in_place"
        else:
            self.close()
            self.engine = build_engine(self.engine_name, model_dir, **self.engine_kwargs())
            self.last_sync = "build"
        self.loaded, self.last_sync_s = ident, time.perf_counter() - t0
        return self.last_sync

    def _sync_from_object_store(self, model_dir: str, ref) -> bool:
        """Take checkpoint model_dir's weights from Ray's object store, reading no file, when the engine already
        holds this model (same architecture: a run's policy versions share it) and takes a state dict; False
        otherwise (the caller loads the committed checkpoint)."""
        want = ref_checkpoint_id(model_dir) or checkpoint_id(model_dir)
        if want is None or self.engine is None or self.loaded is None or not hasattr(self.engine, "load_state"):
            return False
        if want == self.loaded[0]:
            self.last_sync = "cached"
            return True
        self.engine.load_state(ray.get(ref), source=f"checkpoint {want} from Ray's object store")
        self.loaded, self.last_sync = (want, self.loaded[1]), "object_store"
        return True

    def engine_kwargs(self) -> dict:
        """build_engine's keyword arguments on this worker's device: vLLM on CUDA gets its memory share and sleep
        mode, HF its device; on the CPU both get what they always did."""
        kwargs: dict = {"micro_batch_size": self.micro_batch_size, "num_threads": self.num_threads}
        if self.device.type == "cuda":
            if self.engine_name == "vllm":
                kwargs |= {"gpu_memory_utilization": self.gpu_memory_utilization, "enable_sleep_mode": True}
            else:
                kwargs["device"] = str(self.device)
        return kwargs

    def generate(
        self,
        model_dir: str,
        batch: pd.DataFrame,
        sampling: SamplingSpec,
        multi_turn=None,
        use_ray: bool = False,
        weights: Sequence = (),
    ) -> pd.DataFrame:
        """Sync to model_dir, then one row per (prompt row, sample) with token ids, logprobs, finish reason,
        timings, how the engine was synced and the fingerprint of the weights it generated with
        (`engine_weights_fingerprint`: stages.models.fingerprint, read from the engine's model after its
        last load; equal to fingerprint_checkpoint(model_dir) unless the weights never reached it). Sampling
        is seeded by the shard's first prompt_id, so the same prompts get the same seed whatever the sharding.

        multi_turn: rollout.multi_turn (configs.schema.MultiTurnConfig); when enabled each row is a tool-calling
        trajectory (stages.tools.agent_loop) with its response_mask and turns, its tools run as Ray tasks when
        use_ray."""
        if self.engine is not None:
            self.engine.wake_up()  # a no-op unless it sleeps between generations (vLLM on a shared GPU)
        self.sync(model_dir, weights)
        t0 = time.perf_counter()
        seed = None if sampling.seed is None else seeds.engine_shard(sampling.seed, int(batch["prompt_id"].min()))
        spec = SamplingSpec(**{**sampling.__dict__, "seed": seed})
        prompts = [list(map(int, p)) for p in batch["prompt_token_ids"]]
        if multi_turn is not None and multi_turn.enable:
            rows = self._multi_turn_rows(model_dir, batch, prompts, spec, multi_turn, use_ray)
        else:
            rows = self._single_turn_rows(batch, prompts, spec)
        out = pd.DataFrame(rows)
        out["generate_s"] = time.perf_counter() - t0
        out["engine_sync"] = self.last_sync
        out["engine_sync_s"] = self.last_sync_s
        out["engine_weights_fingerprint"] = self.engine.weights_fingerprint()
        self.engine.sleep()  # frees the shared GPU for the trainer (a no-op without sleep mode)
        return out

    def _single_turn_rows(self, batch: pd.DataFrame, prompts: list[list[int]], spec: SamplingSpec) -> list[dict]:
        outs = self.engine.generate(prompts, spec)
        samples = [
            [
                {
                    "response_token_ids": g.token_ids,
                    "rollout_logprobs": g.logprobs,
                    "response_text": g.text,
                    "finish_reason": g.finish_reason,
                }
                for g in gens
            ]
            for gens in outs
        ]
        return self._rows(batch, samples)

    def _multi_turn_rows(self, model_dir: str, batch: pd.DataFrame, prompts, spec, multi_turn, use_ray) -> list[dict]:
        if self.tokenizer is None or self.tokenizer[0] != self.loaded:
            self.tokenizer = (self.loaded, load_tokenizer(resolve_model_dir(model_dir)))
        if self.tools is None or self.tools[0] != multi_turn.tool_config_path:
            self.tools = (multi_turn.tool_config_path, load_tools(multi_turn.tool_config_path))
        tok = self.tokenizer[1]
        trajs = run_agent_loop(self.engine, tok, prompts, spec, multi_turn, self.tools[1], use_ray=use_ray)
        return self._rows(
            batch,
            [
                [
                    {
                        "response_token_ids": tr.token_ids,
                        "rollout_logprobs": tr.logprobs,
                        "response_mask": tr.mask,
                        "response_text": tok.decode(tr.token_ids, skip_special_tokens=True),
                        "finish_reason": tr.finish_reason,
                        "turns": tr.turns,
                    }
                    for tr in samples
                ]
                for samples in trajs
            ],
        )

    def _rows(self, batch: pd.DataFrame, samples: list[list[dict]]) -> list[dict]:
        """One row per (prompt row, sample): the prompt row's columns, then the sample's (response_token_ids,
        rollout_logprobs, response_text, finish_reason, and the multi-turn ones) with its index and length."""
        rows = []
        for (_, prow), per_prompt in zip(batch.iterrows(), samples, strict=True):
            for k, sample in enumerate(per_prompt):
                rows.append(
                    {
                        **prow.to_dict(),
                        "sample_index": k,
                        **sample,
                        "response_length": len(sample["response_token_ids"]),
                        "engine": self.engine.name,
                    }
                )
        return rows

    def close(self) -> None:
        """Free the engine (vLLM holds memory and threads until closed)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        self.engine, self.loaded = None, None
