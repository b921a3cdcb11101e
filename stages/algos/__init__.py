"""Pure RL algorithm functions: torch/numpy only, no I/O, no orchestration."""
