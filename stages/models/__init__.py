"""Models and engines: HF/vLLM rollout engines, policy load/save, the tiny model, SmolLM2."""
