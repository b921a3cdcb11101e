"""The `data` section: prompt files, batch and length limits, the synthetic task."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from configs.sections.base import _Strict


class SyntheticTaskConfig(_Strict):
    """Locally generated task (digit arithmetic or GSM8K-style word problems), in verl's parquet format."""

    task: Literal["addition", "word_problems", "tool_arithmetic"] = "addition"
    """addition: `a+b=` prompts (stages/data/datasets.py); word_problems: GSM8K-style stories with a `####` answer
    (stages/data/word_problems.py), scored with the gsm8k rule; tool_arithmetic: `What is 47*83?` multiplications
    to answer as `#### N` with the calculator tool (stages/data/tool_arith.py, rollout.multi_turn)."""
    num_train: int = 2000
    """Training prompts generated."""
    num_val: int = 128
    """Held-out validation prompts (disjoint operand pairs)."""
    max_operand: int = 49
    """Operands are drawn from [0, max_operand]."""
    operators: list[Literal["+", "-"]] = ["+"]
    """Operators used in the problems."""
    max_steps: int = 2
    """word_problems: arithmetic steps per problem are drawn from 1..max_steps (1 or 2)."""
    fewshot: int = 0
    """word_problems: worked examples ("Question: ... Answer: ... #### N") put before each question, as
    GSM8K few-shot prompting does; small models need them to use the "####" answer format."""
    operand_digits: int = Field(2, ge=1, le=4)
    """tool_arithmetic: digits of each factor (2: 10..99 x 10..99, products up to 4 digits)."""
    tool_schema_path: str | None = None
    """tool_arithmetic: a tool YAML (configs/tools/) whose schemas a Hermes-style system message lists before each
    question, as Qwen2.5's and SmolLM2's tool chat templates render `tools=`; null: no system message (the tiny
    model's 256-position context has no room for it; it learns the call from its warm start)."""
    seed: int = 0
    """Generator seed: the same seed writes the same files."""


class DataConfig(_Strict):
    train_files: list[str] = []
    """verl-format parquet files for training; empty means: generate the synthetic task."""
    val_files: list[str] = []
    """verl-format parquet files for validation; empty means: generate the synthetic task."""
    synthetic: SyntheticTaskConfig = SyntheticTaskConfig()
    """Used when train_files is empty."""
    prompt_key: str = "prompt"
    """Column holding the chat messages."""
    train_batch_size: int = 32
    """Prompts per iteration (before expanding by rollout.n)."""
    max_prompt_length: int = 64
    """Prompts longer than this (in tokens) are rejected at ingest with a clear error."""
    max_response_length: int = 16
    """Maximum generated tokens per response."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded by `seed` and the epoch)."""
    val_batch_size: int = 128
    """Validation prompts evaluated each test_freq iterations."""
    gen_batch_size: int | None = None
    """Prompts per generation round with algorithm.filter_groups (DAPO dynamic sampling: verl's
    data.gen_batch_size); None uses train_batch_size. Only used when filter_groups.enable."""
