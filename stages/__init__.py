"""rlake stages: one module per pipeline asset (prompts, prompt_batch, rollout, ...), and the layers they
build on: workers (Ray actors per role), train, models, data, io, run, algos. docs/architecture.md maps them."""
