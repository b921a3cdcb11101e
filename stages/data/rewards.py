"""Rule-based reward functions, chosen per data_source as verl's default_compute_score does
(verl/utils/reward_score/__init__.py). A scorer returns a float, or a dict with "score" and extra keys.

- gsm8k (verl's `gsm8k.py`): only the last 300 characters are read. method "strict" (default): the
  last `#### <number>` (digits, `.`, `,`, optional leading `-`), commas removed; method "flexible":
  the last number-like match in those 300 characters other than "." (no `####` needed; not
  `.`-stripped, so "18." != "18"); when every match is ".", that "." (verl's loop ends on it). Exact
  string compare with the ground truth: `score` if equal, `format_score` if an answer was extracted,
  0 otherwise.
- MATH (verl's `math_reward.py`, stages/data/math_grader.py): reward.math_method "default" = the
  Hendrycks string match of the last `\\boxed{}` / `\\boxed `, "math_verify" = verl's `math_verify.py`
  (symbolic, needs the `math` extra). `score` if equivalent, else 0.0: verl's MATH scorer has no
  format score, so `format_score` is ignored (a wrong boxed answer earns nothing). A None response
  scores 0.0.
- DAPO (verl's `math_dapo.py`): +1.0 if correct, -1.0 otherwise (`score` and `format_score` are
  ignored), returned as verl does with its extras: {"score", "acc", "pred"} (acc and pred become columns).
- Ground truths are compared as text: a str is used as is; an int (or numpy integer) as its decimal digits
  (7 -> "7"), a finite float as the same digits when it is whole (7.0 -> "7", so a float column that holds
  whole answers still matches `#### 7`) else its shortest round-trip repr (0.5 -> "0.5"); anything else
  (None, a bool, NaN, a list) is an error naming the value (`canonical_ground_truth`). verl compares a
  non-string ground truth as is (gsm8k: never equal to the extracted string; MATH, DAPO: raise); rlake's
  prompts table stores the same text (stages/data/datasets.py).
- rlake's own sources: rlake/arith, rlake/gsm8k_synth and rlake/tool_arith (the synthetic tasks) and the
  alias "gsm8k" score as openai/gsm8k. verl routes none of these four.
- verl routes "math" to its DAPO scorer, and so does rlake (it is not an alias of the MATH scorer).

Installed packages add scorers through the entry-point group `rlake.rewards` (name = data_source, value =
`module:function`), consulted after the built-ins: such a function is called as verl's compute_score
(stages/data/custom_reward.py), and the package must be installed wherever rewards are scored (every Ray node).
A configured reward.custom_reward_function replaces all of this routing.

Versions (the reward_version column): a built-in is `stages.data.rewards:<function>@<hash>`, the hash being
sha256 of the source of this module and stages/data/math_grader.py together (an edit to either changes every
built-in's version: conservative, a helper's change always shows); an entry point's hashes its module's source.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Literal

from stages.data.custom_reward import source_version
from stages.data.math_grader import dapo_verify, last_boxed, math_equiv, math_verify_equiv

_SOLUTION_CLIP_CHARS = 300
_GSM8K_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_FLEXIBLE_RE = re.compile(r"(\-?[0-9\.\,]+)")
GSM8K_METHODS = ("strict", "flexible")


def canonical_ground_truth(value: Any) -> str:
    """The text a scorer compares a ground truth as (module docstring): str as is, a whole number as its
    digits, another finite float as its shortest repr; a TypeError / ValueError for anything else."""
    if isinstance(value, str):
        return value
    is_bool = type(value).__name__ in ("bool", "bool_")  # numpy's too
    if is_bool or not hasattr(value, "__index__") and not hasattr(value, "__float__"):
        raise TypeError(
            f"ground truth {value!r} ({type(value).__name__}) is not a string or a number; the math scorers "
            "compare text, so write reward_model.ground_truth as a string (or an int / float)"
        )
    if hasattr(value, "__index__"):  # int, numpy integers
        return str(int(value))
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"ground truth {value!r} is not a finite number; fix reward_model.ground_truth")
    return str(int(number)) if number.is_integer() else repr(number)


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
    found = _GSM8K_FLEXIBLE_RE.findall(tail)
    numbers = [n for n in found if n not in ("", ".")]
    if numbers:
        return numbers[-1]
    return found[0] if found else None  # only "." matched: verl returns it (and it earns format_score)


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
    return score if answer == canonical_ground_truth(ground_truth) else format_score


MATH_METHODS = ("default", "math_verify")


def score_math(
    response: str | None,
    ground_truth: str,
    *,
    format_score: float = 0.0,
    score: float = 1.0,
    math_method: Literal["default", "math_verify"] = "default",
) -> float:
    """verl's MATH scorer: `score` if the response's answer is equivalent to the ground truth, else 0.0.

    format_score is accepted for the stage's uniform call and ignored: verl's MATH scorer gives a wrong
    boxed answer 0. math_method "math_verify" raises math_grader.RewardTimeout past its time limit.
    """
    del format_score
    ground_truth = canonical_ground_truth(ground_truth)
    if math_method == "math_verify":
        return score if math_verify_equiv(response, ground_truth) else 0.0
    if math_method != "default":
        raise ValueError(
            f"MATH scoring method '{math_method}' is not one of {MATH_METHODS}; set reward.math_method to "
            "'default' (verl's Hendrycks string match) or 'math_verify' (symbolic, needs math-verify)."
        )
    answer = last_boxed(response)
    return score if answer is not None and math_equiv(answer, ground_truth) else 0.0


def score_math_dapo(
    response: str, ground_truth: str, *, format_score: float = 0.0, score: float = 1.0
) -> dict[str, float | bool | str]:
    """verl's DAPO math scorer (math_dapo.compute_score): {"score": +1.0 if correct else -1.0, "acc": correct,
    "pred": the extracted answer}; acc and pred become scored_rollouts columns, as verl's reward_extra_info.
    format_score and score are accepted for the stage's uniform call and ignored."""
    del format_score, score
    correct, pred = dapo_verify(response, canonical_ground_truth(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


REWARD_FNS: dict[str, Callable[..., Any]] = {
    # verl's default_compute_score routes
    "openai/gsm8k": score_gsm8k,
    "lighteval/MATH": score_math,
    "DigitalLearningGmbH/MATH-lighteval": score_math,
    "HuggingFaceH4/MATH-500": score_math,
    "math_dapo": score_math_dapo,
    "math": score_math_dapo,
    "math_dapo_reasoning": score_math_dapo,
    # rlake's own sources and alias (verl has none of them)
    "gsm8k": score_gsm8k,
    "rlake/arith": score_gsm8k,
    "rlake/gsm8k_synth": score_gsm8k,
    "rlake/tool_arith": score_gsm8k,
}
REWARD_PREFIXES: tuple[tuple[str, Callable[..., Any]], ...] = (("aime", score_math_dapo),)
"""(prefix, scorer): a data_source not in REWARD_FNS that starts with the prefix (verl: aime*)."""

# data_sources verl's default_compute_score scores with modules rlake does not implement
_VERL_ONLY = {
    **dict.fromkeys(
        (
            f"numina_{name}"
            for name in ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc", "cn_k12", "olympiads")
        ),
        "prime_math (PRIME's math grader)",
    ),
    **dict.fromkeys(
        ("codecontests", "apps", "codeforces", "taco"), "sandbox_fusion or prime_code (runs the code against tests)"
    ),
    "hiyouga/geometry3k": "geo3k (geometry answers)",
    **dict.fromkeys(
        (
            f"searchR1_{name}"
            for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
        ),
        "search_r1_like_qa_em (Search-R1 exact match)",
    ),
}


ENTRY_POINT_GROUP = "rlake.rewards"
"""Installed packages register scorers here: name = data_source, value = "module:function"."""


@dataclass(frozen=True)
class Scorer:
    """The scorer of a data_source and how it is called."""

    fn: Callable[..., Any]
    verl_call: bool = False
    """False: a built-in, fn(response, ground_truth, *, format_score, score[, method | math_method]); True: an
    entry point, called as verl's compute_score(data_source=, solution_str=, ground_truth=, extra_info=)."""

    @property
    def name(self) -> str:
        """The reward_fn column: module.function."""
        return f"{self.fn.__module__}.{self.fn.__name__}"

    @property
    def version(self) -> str:
        """The reward_version column (module docstring)."""
        if self.fn.__module__ == __name__:
            return source_version(__name__, self.fn.__name__, _source(__name__) + _source(math_equiv.__module__))
        return source_version(self.fn.__module__, self.fn.__name__, _source(self.fn.__module__))


@functools.cache
def _source(module: str) -> bytes:
    """The source of an imported module (b"" when it has none, e.g. an extension module)."""
    try:
        return inspect.getsource(sys.modules[module]).encode()
    except (KeyError, OSError, TypeError):
        return b""


def _entry_point(data_source: str) -> Callable[..., Any] | None:
    """The function an installed package registers for data_source under ENTRY_POINT_GROUP, or None."""
    found = entry_points(group=ENTRY_POINT_GROUP, name=data_source)
    values = sorted({ep.value for ep in found})
    if not values:
        return None
    if len(values) > 1:
        raise ValueError(
            f"data_source '{data_source}' is registered by several installed packages under the entry-point group "
            f"'{ENTRY_POINT_GROUP}' ({values}), so its scorer is ambiguous; uninstall all but one of them."
        )
    ep = next(e for e in found if e.value == values[0])
    try:
        return ep.load()
    except Exception as exc:  # an installed package's import error, reported with the entry point
        raise ValueError(
            f"the '{ENTRY_POINT_GROUP}' entry point {data_source} = {ep.value} cannot be loaded ({exc}); fix or "
            "reinstall the package that registers it."
        ) from exc


def scorer_for(data_source: str) -> Scorer:
    """The scorer of a data_source: REWARD_FNS, then REWARD_PREFIXES, then installed `rlake.rewards` entry
    points. A source verl scores with a code sandbox, PRIME's grader, geo3k or Search-R1 (the _VERL_ONLY
    names) raises, naming verl's module."""
    if data_source in REWARD_FNS:
        return Scorer(REWARD_FNS[data_source])
    for prefix, fn in REWARD_PREFIXES:
        if data_source.startswith(prefix):
            return Scorer(fn)
    registered = _entry_point(data_source)
    if registered is not None:
        return Scorer(registered, verl_call=True)
    fix = (
        "register a scorer for it (stages.data.rewards.REWARD_FNS, or an installed package's "
        f"'{ENTRY_POINT_GROUP}' entry point), set reward.custom_reward_function.path to your own function, or"
    )
    if data_source in _VERL_ONLY:
        raise ValueError(
            f"data_source '{data_source}' is scored in verl by verl.utils.reward_score.{_VERL_ONLY[data_source]}, "
            f"which rlake does not implement; {fix} relabel these rows' data_source."
        )
    raise ValueError(
        f"No reward function for data_source '{data_source}'. Known: {sorted(REWARD_FNS)} and any name starting "
        f"with {[p for p, _ in REWARD_PREFIXES]}; {fix} fix the dataset's data_source."
    )


def reward_fn_for(data_source: str) -> Callable[..., Any]:
    """The scoring function of a data_source (scorer_for's)."""
    return scorer_for(data_source).fn
