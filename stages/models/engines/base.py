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

    def sleep(self) -> None:
        """Free the device memory the engine holds between generations (vLLM's sleep mode on a GPU shared with the
        trainer); a no-op for engines without one."""
        return None

    def wake_up(self) -> None:
        """Undo sleep() before the next load or generate; a no-op when the engine is awake or cannot sleep."""
        return None

    @abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Generation]]:
        """For each prompt, `sampling.n` generations (outer list aligned with the prompts)."""

    @abstractmethod
    def load_checkpoint(self, model_dir: str) -> None:
        """Take the weights of the HF checkpoint at model_dir in place (no engine rebuild)."""

    @abstractmethod
    def weights_fingerprint(self, *, refresh: bool = False) -> str:
        """stages.models.fingerprint of the weights the engine holds, read from the engine's own model after
        its last build or load (cached until the next one, so generate pays nothing); refresh=True reads them
        again now. Equals fingerprint_checkpoint(dir) when the load of dir reached the engine."""
