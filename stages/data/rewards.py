"""Rule-based reward functions, chosen per data_source (verl semantics).

- gsm8k (verl's `gsm8k.compute_score`): only the last 300 characters are read. method "strict"
  (default): the last `#### <number>` (digits, `.`, `,`, optional leading `-`), commas removed;
  method "flexible": the last number anywhere in those 300 characters (no `####` needed; not
  `.`-stripped, so "18." != "18", as in verl). Exact string compare with the ground truth:
  `score` if equal, `format_score` if an answer was extracted, 0 otherwise.
- MATH: the last `\\boxed{...}`, normalised (spaces, `\\left`/`\\right`, `\\!`, `dfrac`, units
  of degrees, trailing `.`), exact compare.
- rlake/arith, rlake/gsm8k_synth (the synthetic tasks): gsm8k semantics.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

_SOLUTION_CLIP_CHARS = 300
_GSM8K_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_FLEXIBLE_RE = re.compile(r"(\-?[0-9\.\,]+)")
GSM8K_METHODS = ("strict", "flexible")


def extract_gsm8k_answer(text: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The answer verl's gsm8k scorer extracts from `text` under `method`, or None."""
    if method not in GSM8K_METHODS:
        raise ValueError(
            f"gsm8k answer extraction method '{method}' is not one of {GSM8K_METHODS}; "
            "set reward.gsm8k_method to 'strict' (needs '#### N') or 'flexible' (last number)."
        )
    tail = text[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT_RE.findall(tail)
        return found[-1].replace(",", "") if found else None
    numbers = [n for n in _GSM8K_FLEXIBLE_RE.findall(tail) if n not in ("", ".")]
    return numbers[-1] if numbers else None


def score_gsm8k(
    response: str,
    ground_truth: str,
    *,
    format_score: float = 0.0,
    score: float = 1.0,
    method: Literal["strict", "flexible"] = "strict",
) -> float:
    answer = extract_gsm8k_answer(response, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth) else format_score


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def normalize_math(s: str) -> str:
    s = s.strip()
    for old, new in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("\\$", ""),
        ("$", ""),
        (" ", ""),
        ("\n", ""),
    ):
        s = s.replace(old, new)
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = s.rstrip(".")
    if s.startswith("."):
        s = "0" + s
    return s


def score_math(response: str, ground_truth: str, *, format_score: float = 0.0, score: float = 1.0) -> float:
    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    return score if normalize_math(boxed) == normalize_math(str(ground_truth)) else format_score


REWARD_FNS: dict[str, Callable[..., float]] = {
    "openai/gsm8k": score_gsm8k,
    "gsm8k": score_gsm8k,
    "rlake/arith": score_gsm8k,
    "rlake/gsm8k_synth": score_gsm8k,
    "lighteval/MATH": score_math,
    "DigitalLearningGmbH/MATH-lighteval": score_math,
    "math": score_math,
}


def reward_fn_for(data_source: str) -> Callable[..., float]:
    try:
        return REWARD_FNS[data_source]
    except KeyError:
        raise ValueError(
            f"No reward function for data_source '{data_source}'. Known: {sorted(REWARD_FNS)}; "
            "register one in stages.data.rewards.REWARD_FNS or fix the dataset's data_source."
        ) from None
