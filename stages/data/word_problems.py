"""GSM8K-style arithmetic word problems, generated locally in verl's parquet format (no download).

Each template is a small story (shopping, ages, rates, collections, sharing, travel) with seeded
numbers and one to `max_steps` arithmetic steps; the answer is an exact non-negative integer
computed from the same numbers, and the worked solution in `extra_info.answer` ends with
`#### <answer>` as GSM8K's does. The prompt is the question followed by verl's gsm8k instruction
(`Let's think step by step and output the final answer after "####".`), so the rows score with
the gsm8k rule (stages/data/rewards.py, data_source `rlake/gsm8k_synth`). Train and validation splits
never share a question text.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from configs.schema import SyntheticTaskConfig
from stages import seeds

WORD_PROBLEM_SOURCE = "rlake/gsm8k_synth"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ["Tom", "Mia", "Sam", "Lena", "Omar", "Ana", "Ben", "Zoe", "Ivan", "Priya", "Leo", "Emma"]
ITEMS = ["apples", "pencils", "books", "stickers", "cookies", "marbles", "cards", "shells"]

# A template: (rng, max_n, steps) -> (question, worked solution, answer); answer >= 0.
Template = Callable[[random.Random, int, int], tuple[str, str, int]]


def _n(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, max(lo, hi))


def shopping(rng: random.Random, m: int, steps: int) -> tuple[str, str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, p = _n(rng, 2, min(m, 9)), _n(rng, 1, min(m, 9))
    cost = a * p
    q = f"{name} buys {a} {item} that cost ${p} each. How many dollars does {name} spend?"
    sol = f"{a} * {p} = {cost}."
    if steps >= 2:
        bill = cost + _n(rng, 1, m)
        q = (
            f"{name} buys {a} {item} that cost ${p} each and pays with ${bill}. "
            f"How many dollars of change does {name} get?"
        )
        sol, cost = f"{a} * {p} = {cost}. {bill} - {cost} = {bill - cost}.", bill - cost
    return q, sol, cost


def ages(rng: random.Random, m: int, steps: int) -> tuple[str, str, int]:
    x, y = rng.sample(NAMES, 2)
    a, b = _n(rng, 3, m), _n(rng, 1, m)
    q = f"{x} is {a} years old. {y} is {b} years older than {x}. How old is {y}?"
    sol, ans = f"{a} + {b} = {a + b}.", a + b
    if steps >= 2:
        c = _n(rng, 1, m)
        q = f"{x} is {a} years old. {y} is {b} years older than {x}. How old will {y} be in {c} years?"
        sol, ans = f"{a} + {b} = {a + b}. {a + b} + {c} = {a + b + c}.", a + b + c
    return q, sol, ans


def rates(rng: random.Random, m: int, steps: int) -> tuple[str, str, int]:
    r, h = _n(rng, 2, min(m, 12)), _n(rng, 2, min(m, 9))
    q = f"A machine makes {r} toys every hour. How many toys does it make in {h} hours?"
    sol, ans = f"{r} * {h} = {r * h}.", r * h
    if steps >= 2:
        k = _n(rng, 1, r * h - 1)
        q = (
            f"A machine makes {r} toys every hour. After {h} hours, {k} of the toys are broken. "
            "How many toys are not broken?"
        )
        sol, ans = f"{r} * {h} = {r * h}. {r * h} - {k} = {r * h - k}.", r * h - k
    return q, sol, ans


def collections(rng: random.Random, m: int, steps: int) -> tuple[str, str, int]:
    x, y = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a = _n(rng, 5, 2 * m)
    b = _n(rng, 1, a - 1)
    q = f"{x} has {a} {item}. {x} gives {b} of them to {y}. How many {item} does {x} have left?"
    sol, ans = f"{a} - {b} = {a - b}.", a - b
    if steps >= 2:
        c = _n(rng, 1, m)
        q = (
            f"{x} has {a} {item}. {x} gives {b} of them to {y} and then finds {c} more. "
            f"How many {item} does {x} have now?"
        )
        sol, ans = f"{a} - {b} = {a - b}. {a - b} + {c} = {a - b + c}.", a - b + c
    return q, sol, ans


def sharing(rng: random.Random, m: int, steps: int) -> tuple[str, str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    k, each = _n(rng, 2, min(m, 9)), _n(rng, 2, min(m, 9))
    total = k * each
    q = f"{name} shares {total} {item} equally among {k} friends. How many {item} does each friend get?"
    sol, ans = f"{total} / {k} = {each}.", each
    if steps >= 2:
        c = _n(rng, 1, each - 1)
        q = (
            f"{name} shares {total} {item} equally among {k} friends, and each friend then loses {c}. "
            f"How many {item} does each friend have left?"
        )
        sol, ans = f"{total} / {k} = {each}. {each} - {c} = {each - c}.", each - c
    return q, sol, ans


def travel(rng: random.Random, m: int, steps: int) -> tuple[str, str, int]:
    name = rng.choice(NAMES)
    s, h = _n(rng, 2, min(m, 15)), _n(rng, 2, min(m, 6))
    q = f"{name} rides a bike at {s} miles per hour for {h} hours. How many miles does {name} ride?"
    sol, ans = f"{s} * {h} = {s * h}.", s * h
    if steps >= 2:
        w = _n(rng, 1, m)
        q = (
            f"{name} rides a bike at {s} miles per hour for {h} hours and then walks {w} more miles. "
            f"How many miles does {name} travel in total?"
        )
        sol, ans = f"{s} * {h} = {s * h}. {s * h} + {w} = {s * h + w}.", s * h + w
    return q, sol, ans


TEMPLATES: dict[str, Template] = {
    "shopping": shopping,
    "ages": ages,
    "rates": rates,
    "collections": collections,
    "sharing": sharing,
    "travel": travel,
}


def fewshot_prefix(examples: list[tuple[str, str, str, int, int]]) -> str:
    """Worked examples in GSM8K's few-shot layout: "Question: q\nAnswer: steps\n#### N\n\n" each."""
    return "".join(f"Question: {q}\nAnswer: {sol}\n#### {ans}\n\n" for _, q, sol, ans, _ in examples)


def make_word_problem_row(
    question: str, solution: str, answer: int, *, template: str, steps: int, split: str, index: int, prefix: str = ""
) -> dict:
    """One verl-format row (as verl's gsm8k preprocessing writes it); `prefix`: few-shot examples."""
    content = f"{prefix}Question: {question} {INSTRUCTION}" if prefix else f"{question} {INSTRUCTION}"
    return {
        "data_source": WORD_PROBLEM_SOURCE,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {
            "split": split,
            "index": index,
            "question": question,
            "answer": f"{solution}\n#### {answer}",
            "template": template,
            "steps": steps,
        },
    }


def sample_problems(
    count: int, *, max_number: int, max_steps: int, seed: int, exclude: frozenset[str] = frozenset()
) -> list[tuple[str, str, str, int, int]]:
    """`count` distinct problems (template, question, solution, answer, steps), seeded; none in `exclude`."""
    if max_steps not in (1, 2):
        raise ValueError(
            f"synthetic.max_steps ({max_steps}) must be 1 or 2 for task 'word_problems', because the "
            "templates have one- and two-step variants; set max_steps to 1 or 2."
        )
    if max_number < 5:
        raise ValueError(
            f"synthetic.max_operand ({max_number}) must be >= 5 for task 'word_problems', because the "
            "templates need room for distinct numbers; raise max_operand."
        )
    rng = random.Random(seed)
    names = sorted(TEMPLATES)
    seen: set[str] = set(exclude)
    out: list[tuple[str, str, str, int, int]] = []
    for _ in range(count * 50):
        if len(out) == count:
            return out
        template = rng.choice(names)
        steps = rng.randint(1, max_steps)
        question, solution, answer = TEMPLATES[template](rng, max_number, steps)
        if question not in seen:
            seen.add(question)
            out.append((template, question, solution, answer, steps))
    raise ValueError(
        f"could generate only {len(out)} distinct word problems of the {count} asked "
        f"(synthetic.num_train + num_val) with max_operand={max_number}, max_steps={max_steps}; "
        "raise max_operand or max_steps, or lower num_train."
    )


def generate_word_problem_task(out_dir: str | Path, cfg: SyntheticTaskConfig) -> tuple[str, str]:
    """Write train.parquet and val.parquet (no shared question); returns their paths.

    cfg: configs.schema.SyntheticTaskConfig (num_train, num_val, max_operand, max_steps, fewshot, seed).
    With fewshot > 0 every prompt starts with the same `fewshot` worked examples (drawn with stages.seeds.fewshot(seed),
    never a train or val question), then "Question: <q> <instruction>".
    """
    shots: list[tuple[str, str, str, int, int]] = []
    for shot in (
        sample_problems(
            50 * cfg.fewshot, max_number=cfg.max_operand, max_steps=cfg.max_steps, seed=seeds.fewshot(cfg.seed)
        )
        if cfg.fewshot > 0
        else []
    ):
        if len(shots) < cfg.fewshot and (shot[0] not in {t for t, *_ in shots} or cfg.fewshot > len(TEMPLATES)):
            shots.append(shot)  # examples of distinct templates
    prefix = fewshot_prefix(shots)
    problems = sample_problems(
        cfg.num_train + cfg.num_val,
        max_number=cfg.max_operand,
        max_steps=cfg.max_steps,
        seed=cfg.seed,
        exclude=frozenset(q for _, q, _, _, _ in shots),
    )
    splits = {"val": problems[: cfg.num_val], "train": problems[cfg.num_val :]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in splits.items():
        path = out / f"{name}.parquet"
        pd.DataFrame(
            [
                make_word_problem_row(q, sol, ans, template=t, steps=s, split=name, index=i, prefix=prefix)
                for i, (t, q, sol, ans, s) in enumerate(rows)
            ]
        ).to_parquet(path, index=False)
        paths[name] = str(path)
    return paths["train"], paths["val"]
