"""Multi-digit multiplication to answer with a calculator tool (issue #21), in verl's parquet format.

A prompt asks `What is 47*83? Use the calculator.`; the ground truth is the product, scored like rlake/arith
(the gsm8k strict rule, `#### N`; data_source `rlake/tool_arith`). The tiny model cannot multiply two 2-digit
numbers, but it can copy the expression into a Hermes tool call
(`<tool_call>{"name": "calculator", "arguments": {"expression": "47*83"}}</tool_call>`) and the calculator's
answer out of the observation, so reward rises with tool use (stages/tools/agent_loop.py runs the calls). Train and
validation never share an operand pair, in either order. With synthetic.tool_schema_path a Hermes-style system
message lists the tools' schemas first, as Qwen2.5's tool chat template renders `tools=`, and asks for the answer
after "####"; the tiny model goes without (its 256-position context has no room for it) and learns the call and
the answer format from its warm start (stages/initial_policy.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd
import yaml

from configs.schema import SyntheticTaskConfig

TOOL_ARITH_SOURCE = "rlake/tool_arith"
CALCULATOR = "calculator"
INSTRUCTION = "Use the calculator."
ANSWER_FORMAT = 'After the tool has answered, write the final answer after "####", e.g. "#### 42".'
REPO_ROOT = Path(__file__).resolve().parents[2]

HERMES_SYSTEM = (
    "You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""Qwen2.5's tool system prompt (its chat template's `tools` block), {tools} = one JSON schema per line."""


def hermes_tool_call(name: str, arguments: dict) -> str:
    """One Hermes tool call: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (json.dumps spacing)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def resolve_tool_yaml(path: str | Path) -> Path:
    """A tool YAML path as given, else relative to the repository (configs/tools/...), or a clear error."""
    p = Path(path)
    for candidate in (p, REPO_ROOT / p):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"tool YAML '{path}' (data.synthetic.tool_schema_path) does not exist here or under {REPO_ROOT}; "
        "point it at a file such as configs/tools/calculator.yaml, or set it to null"
    )


def hermes_system_prompt(tool_yaml: str | Path) -> str:
    """The Hermes system message listing the `tool_schema` of every tool in a verl tool YAML, then ANSWER_FORMAT."""
    path = resolve_tool_yaml(tool_yaml)
    tools = (yaml.safe_load(path.read_text()) or {}).get("tools") or []
    schemas = [t.get("tool_schema") for t in tools if isinstance(t, dict)]
    if not schemas or not all(isinstance(s, dict) for s in schemas):
        raise ValueError(
            f"{path}: expected `tools: [{{class_name, config, tool_schema}}, ...]` (verl's tool config) with a "
            "tool_schema mapping per tool, so the system prompt can list them; fix the file"
        )
    return HERMES_SYSTEM.format(tools="\n".join(json.dumps(s) for s in schemas)) + "\n\n" + ANSWER_FORMAT


def operand_pairs(digits: int) -> list[tuple[int, int]]:
    """Unordered factor pairs (a <= b) of `digits`-digit numbers, in a fixed order."""
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    return [(a, b) for a in range(lo, hi + 1) for b in range(a, hi + 1)]


def make_tool_arith_row(a: int, b: int, *, split: str, index: int, system: str | None) -> dict:
    """One verl row asking for a*b; extra_info.expression is what a calculator call should be given."""
    expression = f"{a}*{b}"
    prompt = [{"role": "user", "content": f"What is {expression}? {INSTRUCTION}"}]
    return {
        "data_source": TOOL_ARITH_SOURCE,
        "prompt": ([{"role": "system", "content": system}] if system else []) + prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {"split": split, "index": index, "expression": expression, "answer": f"#### {a * b}"},
    }


def generate_tool_arith_task(out_dir: str | Path, cfg: SyntheticTaskConfig) -> tuple[str, str]:
    """Write train.parquet and val.parquet (no operand pair in both, in either order); returns their paths.

    cfg: configs.schema.SyntheticTaskConfig (num_train, num_val, operand_digits, tool_schema_path, seed).
    Each pair is asked as a*b or b*a (seeded); train cycles through its pairs when num_train exceeds them.
    """
    rng = random.Random(cfg.seed)
    space = operand_pairs(cfg.operand_digits)
    if cfg.num_val + 1 > len(space):
        raise ValueError(
            f"synthetic.num_val ({cfg.num_val}) leaves no training problems among the {len(space)} factor pairs "
            f"of {cfg.operand_digits}-digit numbers; raise synthetic.operand_digits or lower num_val"
        )
    rng.shuffle(space)
    space = [(a, b) if rng.random() < 0.5 else (b, a) for a, b in space]
    val, rest = space[: cfg.num_val], space[cfg.num_val :]
    train = [rest[i % len(rest)] for i in range(cfg.num_train)]
    system = hermes_system_prompt(cfg.tool_schema_path) if cfg.tool_schema_path else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, pairs in (("train", train), ("val", val)):
        path = out / f"{name}.parquet"
        rows = [make_tool_arith_row(a, b, split=name, index=i, system=system) for i, (a, b) in enumerate(pairs)]
        pd.DataFrame(rows).to_parquet(path, index=False)
        paths.append(str(path))
    return paths[0], paths[1]
