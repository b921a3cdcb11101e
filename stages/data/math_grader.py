"""Grading of final math answers, written from verl's semantics (verl/utils/reward_score/):

- Hendrycks MATH (`math_reward.py`, after lm-evaluation-harness): the last `\\boxed{...}` of the
  response, or the text after the last `\\boxed ` up to a `$`; both sides normalised (`normalize_math`)
  and compared as strings. Where verl's normalisation raises (two `\\text{ ` unit suffixes, a bare
  trailing `\\sqrt` or `\\frac`), the raw strings are compared instead, as verl does.
- DAPO (`math_dapo.py`): the last `Answer: ...` line of the response's final 300 characters, both sides
  normalised (`normalize_dapo_answer`); without one, the last `\\boxed{...}` of the final 100 characters
  compared raw with the ground truth.
- Math-Verify (`math_verify.py`): the ground truth wrapped in `\\boxed{}` and the response parsed by the
  `math-verify` package and compared symbolically. Its own timeouts use SIGALRM, which only works on a
  process's main thread, so rlake disables them and runs every comparison in one child process
  per scoring process, under a wall-clock limit (MATH_VERIFY_TIMEOUT_S, verl's 30 s): a row over the
  limit gets its child killed and replaced and raises RewardTimeout, which the reward stage turns into
  score 0.0 with reward_error set (verl's timeout_score 0).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

MATH_VERIFY_TIMEOUT_S = 30.0
"""Wall-clock limit of one math_verify comparison (verl's math_verify.compute_score default)."""
_START_TIMEOUT_S = 300.0  # spawning the child and importing sympy: slow on a loaded machine, not a row's fault
_DAPO_CLIP_CHARS = 300  # verl reads the last 300 characters ("the longest MATH-500 answer has 159")
_DAPO_BOX_CLIP_CHARS = 100  # ... and its \boxed{} fallback only the last 100 of those
_DAPO_INVALID = "[INVALID]"
_DAPO_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


class RewardTimeout(Exception):
    """A scorer ran over its wall-clock limit; the reward stage scores the row 0.0 and flags it."""


# ---- Hendrycks MATH (verl math_reward.py) -------------------------------------------------------

# (old, new) replacements before and after the unit suffix is cut, in verl's order
_BEFORE_UNITS = (
    ("\n", ""),
    ("\\!", ""),
    ("\\\\", "\\"),
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\$", ""),
)
_AFTER_UNITS = (("\\\\%", ""), ("\\%", ""), (" .", " 0."), ("{.", "{0."))


def _balanced_end(text: str, start: int) -> int | None:
    """Index of the `}` that closes the first `{` at or after `start`, or None."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return None


def last_boxed(text: str | None) -> str | None:
    """The final answer verl's MATH scorer reads (last_boxed_only_string + remove_boxed), or None.

    If `\\boxed ` (with a space) occurs anywhere, the answer is the text after its last occurrence up to
    the next `$`; otherwise the content of the last `\\boxed{...}` (balanced braces). A `\\boxed` not
    followed by `{`, an unclosed box and verl's `\\fbox{}` fallback (whose unboxing fails there) give None.
    """
    if not isinstance(text, str):
        return None
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    end = None if start < 0 else _balanced_end(text, start)
    if end is None or not text.startswith("\\boxed{", start):
        return None
    return text[start + len("\\boxed{") : end]


def _fix_sqrt(s: str) -> str | None:
    """`\\sqrt2` -> `\\sqrt{2}` (one character); None where verl raises (a `\\sqrt` at the very end)."""
    head, *parts = s.split("\\sqrt")
    out = [head]
    for part in parts:
        if not part:
            return None
        out.append("\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:])
    return "".join(out)


def _fix_fracs(s: str) -> str | None:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`; a `\\frac` with under two characters
    after it leaves `s` unchanged, and an empty one (verl raises) gives None."""
    head, *parts = s.split("\\frac")
    out = [head]
    for part in parts:
        if not part:
            return None
        if part[0] == "{":
            out.append("\\frac" + part)
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out.append("\\frac{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest))
    return "".join(out)


def _fix_a_slash_b(s: str) -> str:
    """`1/2` -> `\\frac{1}{2}` when `s` is exactly two canonical integers around one slash."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def normalize_math(s: object) -> str | None:
    """verl's strip_string: the canonical form of a MATH answer, or None where verl's raises (the
    caller then compares the raw strings, as verl's is_equiv does)."""
    if not isinstance(s, str):
        return None
    for old, new in _BEFORE_UNITS:
        s = s.replace(old, new)
    if "\\text{ " in s:  # units on the right: verl keeps what precedes the only "\text{ "
        head, *units = s.split("\\text{ ")
        if len(units) != 1:
            return None
        s = head
    for old, new in _AFTER_UNITS:
        s = s.replace(old, new)
    if s.startswith("."):
        s = "0" + s
    lhs, *rhs = s.split("=")
    if len(rhs) == 1 and len(lhs) <= 2:  # "k = 3", "x=3": keep the value
        s = rhs[0]
    s = _fix_sqrt(s)
    if s is None:
        return None
    s = _fix_fracs(s.replace(" ", ""))
    if s is None:
        return None
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def math_equiv(answer: str | None, ground_truth: str | None) -> bool:
    """verl's is_equiv: equal after normalize_math; raw equality where normalising fails; two Nones
    are equal, one None is not."""
    if answer is None or ground_truth is None:
        return answer is None and ground_truth is None
    a, b = normalize_math(answer), normalize_math(ground_truth)
    if a is None or b is None:
        return answer == ground_truth
    return a == b


# ---- DAPO (verl math_dapo.py) -------------------------------------------------------------------

_DAPO_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# units, words and TeX spacing deleted, in this order
_DAPO_REMOVED = (
    *("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue"),
    *("points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals"),
    *("edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}"),
    *("\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;"),
    *(",\\!", "{,}", '"', "\\dots"),
)


def normalize_dapo_answer(answer: str) -> str:
    """verl's normalize_final_answer (Minerva): the right-hand side of the last `=`, units and words
    removed, the first `$...$` kept, `\\text{}`/`\\textbf{}`/`\\overline{}`/`\\boxed{}` unwrapped, `\\fracab`
    and `\\sqrta` braced, `$` dropped, commas dropped from a plain integer."""
    answer = answer.split("=")[-1]
    for old, new in _DAPO_SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for word in _DAPO_REMOVED:
        answer = answer.replace(word, "")
    answer = re.sub(r".*?\$(.*?)\$.*", r"$\1$", answer)
    for macro in ("text", "textbf", "overline"):
        answer = re.sub(r"\\" + macro + r"\{(.*?)\}", r"\1", answer)
    answer = re.sub(r"\\boxed\{(.*)\}", r"\1", answer)
    answer = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", answer)
    answer = re.sub(r"sqrt([^{])", r"sqrt{\1}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_verify(response: str, ground_truth: str) -> tuple[bool, str]:
    """verl's math_dapo verify (strict_box_verify off) on the response's last 300 characters: (correct, pred),
    pred = the normalized `Answer:` text, else the last boxed answer as written, else "[INVALID]"."""
    tail = response[-_DAPO_CLIP_CHARS:]
    found = _DAPO_ANSWER_RE.findall(tail)
    pred = normalize_dapo_answer(found[-1] if found else _DAPO_INVALID)
    if pred != _DAPO_INVALID:
        return pred == normalize_dapo_answer(ground_truth), pred
    box_tail = tail[-_DAPO_BOX_CLIP_CHARS:]
    start = box_tail.rfind("\\boxed{")
    end = None if start < 0 else _balanced_end(box_tail, start)
    if end is None:
        return False, pred
    boxed = box_tail[start + len("\\boxed{") : end]
    return boxed == ground_truth, boxed


def dapo_correct(response: str, ground_truth: str) -> bool:
    """Whether verl's math_dapo verify accepts the response (dapo_verify's first item)."""
    return dapo_verify(response, ground_truth)[0]


# ---- Math-Verify (verl math_verify.py) ----------------------------------------------------------


def require_math_verify() -> None:
    """Import math-verify, or fail saying what needs it and how to install it."""
    try:
        import math_verify  # noqa: F401, PLC0415 - math-verify is an optional extra
    except ImportError as exc:
        raise ModuleNotFoundError(
            "reward.math_method='math_verify' needs the math-verify package, which scores MATH answers by "
            f"symbolic equivalence, and it cannot be imported ({exc}); install it with "
            "`pip install 'rlake[math]'` (or `bash scripts/install.sh math`), or set reward.math_method='default'."
        ) from exc


def _load_math_verify() -> None:
    """The child's start-up: import math-verify and silence its warning that its own timeouts are off."""
    import math_verify  # noqa: F401, PLC0415 - math-verify is an optional extra

    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _verify_pair(gold_boxed: str, response: str) -> bool:
    """verl's comparison: any parse of the response equals any parse of the gold (timeouts off: the
    caller bounds the wall-clock time)."""
    from math_verify import parse, verify  # noqa: PLC0415 - math-verify is an optional extra
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig  # noqa: PLC0415 - optional extra

    gold = parse(gold_boxed, (LatexExtractionConfig(),), parsing_timeout=None)
    preds = parse(response, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=None)
    return any(verify(g, p, timeout_seconds=None) for p in preds for g in gold)


def _serve(request_fd: int, result_fd: int) -> None:
    """The child's loop: run its start-up call, then each (fn, args) it receives, sending back (ok, result
    or error text); returns when the parent closes the request pipe (or dies)."""
    requests, results = Connection(request_fd, writable=False), Connection(result_fd, readable=False)
    init = requests.recv()
    try:
        if init is not None:
            init()
    except Exception as exc:  # e.g. an import error: the parent raises it
        results.send((False, f"{type(exc).__name__}: {exc}"))
        return
    results.send((True, "ready"))
    while True:
        try:
            fn, args = requests.recv()
        except EOFError:
            return
        try:
            results.send((True, fn(*args)))
        except Exception as exc:  # sent to the parent, which raises it for the row
            results.send((False, f"{type(exc).__name__}: {exc}"))


class ScorerProcess:
    """One child Python process running scoring calls one at a time, each under a wall-clock limit.

    A call over its limit kills the child (a hung sympy simplification cannot be interrupted from
    another thread) and raises RewardTimeout; the next call starts a fresh child. Safe to call from
    any thread. The child is a new interpreter with the parent's sys.path (not a fork: the parent may be
    a Ray worker with threads of its own; not multiprocessing's spawn, which re-runs an unguarded
    __main__ script), talking over two pipes.
    """

    def __init__(self, init: Callable[[], None] | None = None) -> None:
        self._init = init
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._requests: Connection | None = None
        self._results: Connection | None = None

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """fn(*args) in the child (fn and args must pickle); RewardTimeout after timeout_s seconds."""
        with self._lock:
            self._start()
            self._requests.send((fn, args))
            if not self._results.poll(timeout_s):
                self.stop()
                raise RewardTimeout(f"{fn.__name__} ran over {timeout_s:g} s; its process was killed")
            return self._result(fn.__name__)

    def _start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self.stop()
        request_r, request_w = os.pipe()
        result_r, result_w = os.pipe()
        code = (
            f"import sys; sys.path[:] = sys.argv[3:]; from {__name__} import _serve; "
            "_serve(int(sys.argv[1]), int(sys.argv[2]))"
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, str(request_r), str(result_w), *sys.path],
            pass_fds=(request_r, result_w),
            stdin=subprocess.DEVNULL,
        )
        os.close(request_r)
        os.close(result_w)
        self._requests, self._results = Connection(request_w, readable=False), Connection(result_r, writable=False)
        self._requests.send(self._init)
        if not self._results.poll(_START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"the scoring process did not start within {_START_TIMEOUT_S:g} s")
        self._result("start-up")

    def _result(self, what: str) -> Any:
        try:
            ok, value = self._results.recv()
        except EOFError:
            self.stop()
            raise RuntimeError(f"the scoring process died during {what}") from None
        if not ok:
            raise RuntimeError(f"{what} failed in the scoring process: {value}")
        return value

    def stop(self) -> None:
        """Kill the child, if any (the next call starts a new one)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._requests.close()
            self._results.close()
        self._proc = self._requests = self._results = None


@functools.cache
def _math_verify_process() -> ScorerProcess:
    """This process's math-verify child (a Ray worker keeps its child across reward tasks)."""
    return ScorerProcess(init=_load_math_verify)


def math_verify_equiv(
    response: str | None, ground_truth: str | None, *, timeout_s: float = MATH_VERIFY_TIMEOUT_S
) -> bool:
    """verl's math_verify.compute_score as a bool; raises RewardTimeout past `timeout_s` seconds. A
    non-string response or ground truth is wrong (verl's string concatenation fails and scores 0)."""
    require_math_verify()
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return False
    return bool(
        _math_verify_process().call(_verify_pair, "\\boxed{" + ground_truth + "}", response, timeout_s=timeout_s)
    )
