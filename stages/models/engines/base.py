"""The rollout engine interface every generation backend implements.

An engine is built once per RolloutWorker (stages/workers) from a HF-format checkpoint directory, generates
from already-tokenized prompts, and can take new weights in place after a policy update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling settings, engine-neutral (mirrors configs.schema.RolloutConfig)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    n: int = 1
    """Samples per prompt returned by one generate call."""
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    greedy: bool = False


@dataclass(frozen=True)
class Generation:
    """One sampled response."""

    token_ids: list[int]
    """Response token ids, EOS included when generation stopped on it."""
    logprobs: list[float]
    """Log-prob of each sampled token under the engine's sampling distribution, len == token_ids."""
    finish_reason: str
    """'stop' (EOS or a stop string) or 'length' (hit max_tokens)."""
    text: str


class RolloutEngine(ABC):
    """Generation backend: HF transformers or vLLM."""

    name: str = "base"

    @abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Generation]]:
        """For each prompt, `sampling.n` generations (outer list aligned with the prompts)."""

    @abstractmethod
    def load_checkpoint(self, model_dir: str) -> None:
        """Take the weights of the HF checkpoint at model_dir in place (no engine rebuild)."""
