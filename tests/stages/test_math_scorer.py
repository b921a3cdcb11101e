"""The MATH scorer under both reward.math_method values, against hand-derived values (verl's
math_reward.py and math_verify.py semantics), and the child process that bounds math_verify's time."""

from __future__ import annotations

import sys
import threading
import time

import pandas as pd
import pytest

from configs.schema import RewardConfig
from stages.data.math_grader import (
    RewardTimeout,
    ScorerProcess,
    last_boxed,
    math_equiv,
    normalize_math,
    require_math_verify,
)
from stages.data.rewards import score_math
from stages.scored_rollouts import RewardStage, score_rollouts

# (response, ground truth, default score, math_verify score). default = verl's Hendrycks string match
# of the last box; math_verify = verl's symbolic compare of parse(response) with parse(\boxed{gt}).
ANSWER_FORMS = [
    # \frac12 -> \frac{1}{2} (fix_fracs); sympy: 1/2 == 1/2
    (r"so \boxed{\frac12}", r"\frac{1}{2}", 1.0, 1.0),
    # "1/2" -> \frac{1}{2} (fix_a_slash_b: two integers around one slash); sympy 1/2
    (r"\boxed{1/2}", r"\frac{1}{2}", 1.0, 1.0),
    # "0.5" is rewritten to \frac{1}{2} by name; numerically 0.5 == 1/2
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0, 1.0),
    # leading "." gets a "0" -> "0.5" -> \frac{1}{2}; .5 parses as 0.5
    (r"\boxed{.5}", r"\frac{1}{2}", 1.0, 1.0),
    # the gt side is normalised too: "0.5" -> \frac{1}{2} == \frac12 -> \frac{1}{2}
    (r"\boxed{\frac12}", "0.5", 1.0, 1.0),
    # "x=3": one "=", left side <= 2 chars -> "3"; math_verify reads the assignment's value
    (r"\boxed{x=3}", "3", 1.0, 1.0),
    # "k = 3": left side "k " has 2 chars -> " 3" -> spaces removed -> "3"
    (r"\boxed{k = 3}", "3", 1.0, 1.0),
    # "xyz" is 3 chars: the prefix stays, "xyz=3" != "3"; math_verify: xyz=3 is an equation whose
    # right side 3 equals the gold
    (r"\boxed{xyz=3}", "3", 0.0, 1.0),
    # \sqrt2 -> \sqrt{2} (fix_sqrt); sympy sqrt(2)
    (r"\boxed{\sqrt2}", r"\sqrt{2}", 1.0, 1.0),
    # "\%" is removed; math_verify reads 10% as 10/100 and accepts it against 10 (percent rule)
    (r"\boxed{10\%}", "10", 1.0, 1.0),
    # a bare "%" is NOT removed by verl's strip_string: "10%" != "10"; math_verify as above
    (r"\boxed{10%}", "10", 0.0, 1.0),
    # "\text{ " (with the space) marks a unit: everything from it on is cut; math_verify drops text
    (r"\boxed{5\text{ cm}}", "5", 1.0, 1.0),
    # "\text{cm}" without the space is not a unit for verl: "5\text{cm}" != "5"; math_verify drops text
    (r"\boxed{5\text{cm}}", "5", 0.0, 1.0),
    # two "\text{ " suffixes: verl's remove_right_units raises, so the raw strings are compared
    # ("1\text{ m}\text{ s}" != "1"); math_verify reads 1
    (r"\boxed{1\text{ m}\text{ s}}", "1", 0.0, 1.0),
    # the space form: the text after the last "\boxed " up to "$"; math_verify's expression parse finds 5
    (r"the answer is \boxed 5", "5", 1.0, 1.0),
    (r"so $\boxed 5$.", "5", 1.0, 1.0),
    # "\boxed {5}" is the space form too, so the answer is "{5}" (braces kept) != "5"; math_verify
    # extracts nothing from it
    (r"\boxed {5}", "5", 0.0, 0.0),
    # \dfrac -> \frac
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0, 1.0),
    # \tfrac -> \frac
    (r"\boxed{\tfrac{1}{2}}", r"\frac{1}{2}", 1.0, 1.0),
    # \left and \right are deleted; math_verify: the tuple (1, 2)
    (r"\boxed{\left(1,2\right)}", "(1,2)", 1.0, 1.0),
    # degrees: "^\circ" and "^{\circ}" are deleted; math_verify drops the degree sign
    (r"\boxed{90^\circ}", "90", 1.0, 1.0),
    (r"\boxed{90^{\circ}}", "90", 1.0, 1.0),
    # "\$" is deleted (dollars); math_verify reads 5
    (r"\boxed{\$5}", "5", 1.0, 1.0),
    # "\!" (negative thin space) is deleted: "2000"
    (r"\boxed{2\!000}", "2000", 1.0, 1.0),
    # thousands separator: verl keeps the comma ("1,000" != "1000"); math_verify reads 1000
    (r"\boxed{1,000}", "1000", 0.0, 1.0),
    # "3.0" vs "3": default compares strings, so wrong; math_verify compares numbers, so right
    (r"\boxed{3.0}", "3", 0.0, 1.0),
    # a trailing "." stays for verl ("7." != "7"); math_verify cannot parse "7." and the string
    # fallback "7." != "7"
    (r"\boxed{7.}", "7", 0.0, 0.0),
    # spaces inside the box are removed
    (r"\boxed{ 7 }", "7", 1.0, 1.0),
    # linebreaks are removed
    ("\\boxed{4\n}", "4", 1.0, 1.0),
    # intervals: spaces removed, brackets compared as text; sympy Interval(0, 1, False, True) etc.
    (r"\boxed{[0,1)}", "[0,1)", 1.0, 1.0),
    (r"\boxed{(0, 1]}", "(0,1]", 1.0, 1.0),
    (r"\boxed{[1, 2]}", "[1,3]", 0.0, 0.0),  # different intervals
    # "x \in [2, 5]" is not "[2,5]" as text; math_verify reads x in [2, 5] as the interval [2, 5]
    (r"\boxed{x \in [2, 5]}", "[2,5]", 0.0, 1.0),
    # tuples are ordered for both
    (r"\boxed{(1, 2)}", "(2, 1)", 0.0, 0.0),
    # "2, 1" vs "1, 2": different text; math_verify reads both as the set {1, 2}
    (r"\boxed{2, 1}", "1, 2", 0.0, 1.0),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}", 0.0, 1.0),  # sets: text differs, sets are equal
    # negative numbers
    (r"\boxed{-5}", "-5", 1.0, 1.0),
    (r"\boxed{-5}", "5", 0.0, 0.0),
    # the sign inside vs outside the fraction: different text, equal values
    (r"\boxed{\frac{-1}{2}}", r"-\frac{1}{2}", 0.0, 1.0),
    # nested braces are balanced; the gt's \sqrt3 -> \sqrt{3}
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0, 1.0),
    # equal values, different text: only math_verify simplifies
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 0.0, 1.0),
    (r"\boxed{x^2+1}", "1+x^2", 0.0, 1.0),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", 0.0, 1.0),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 0.0, 1.0),
    # math_verify rounds to 6 decimals: 1/3 == 0.333333; the text differs
    (r"\boxed{\frac{1}{3}}", "0.333333", 0.0, 1.0),
    (r"\boxed{\pi}", r"\pi", 1.0, 1.0),
    (r"\boxed{3.14}", r"\pi", 0.0, 0.0),  # not equal at 6 decimals
    (r"\boxed{\infty}", r"\infty", 1.0, 1.0),
    # units in the gt are cut the same way: "5" == "5"
    (r"\boxed{5\text{ cm}}", r"5\text{ cm}", 1.0, 1.0),
    # no box: default scores 0; math_verify's expression parse reads the plain 5
    ("the answer is 5", "5", 0.0, 1.0),
    # the last box counts for default; math_verify reads both boxes as the set {1, 2}, equal to neither
    (r"\boxed{1} then \boxed{2}", "2", 1.0, 0.0),
    (r"\boxed{1} then \boxed{2}", "1", 0.0, 0.0),
    # \fbox: verl falls back to it, then fails to unbox it -> 0; math_verify extracts nothing
    (r"\fbox{5}", "5", 0.0, 0.0),
    # an unclosed box has no answer
    (r"\boxed{5", "5", 0.0, 0.0),
    # a bare trailing \sqrt: verl's fix_sqrt raises, raw strings compared ("\sqrt" == "\sqrt"); math_verify
    # keeps both as the string "\sqrt" and compares them as strings
    (r"\boxed{\sqrt}", r"\sqrt", 1.0, 1.0),
    # a None response (e.g. a failed generation) scores 0 under both
    (None, "5", 0.0, 0.0),
]


@pytest.mark.parametrize("response,gt,expected,_", ANSWER_FORMS)
def test_default_method(response, gt, expected, _) -> None:
    assert score_math(response, gt) == expected
    assert score_math(response, gt, math_method="default") == expected


@pytest.mark.parametrize("response,gt,_,expected", ANSWER_FORMS)
def test_math_verify_method(response, gt, _, expected) -> None:
    assert score_math(response, gt, math_method="math_verify") == expected


def test_a_wrong_boxed_answer_gets_no_format_score() -> None:
    # verl's MATH scorer has no format score: a box with the wrong value is 0, whatever format_score
    assert score_math(r"\boxed{4}", "5", format_score=0.5) == 0.0
    assert score_math(r"\boxed{4}", "5", format_score=0.5, math_method="math_verify") == 0.0
    assert score_math(r"\boxed{5}", "5", score=2.0) == 2.0  # `score` scales a correct answer


def test_unknown_math_method_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'sympy' is not one of \('default', 'math_verify'\); set reward.math_method"):
        score_math(r"\boxed{5}", "5", math_method="sympy")


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"\boxed{a{b}c}", "a{b}c"),  # balanced braces
        (r"\boxed{1} and \boxed{2}", "2"),  # the last one
        (r"\boxed 7 and $x$", "7 and "),  # space form: up to the next "$"
        (r"\boxed 3 then \boxed{4}", "3 then \\boxed{4}"),  # any "\boxed " wins over a later brace box
        (r"\boxed{unclosed", None),
        (r"\boxed\frac{1}{2}", None),  # "\boxed" not followed by "{": verl's unboxing fails
        (r"\fbox{5}", None),
        ("no box", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "raw,expected",
    [
        (r"\frac1{72}", r"\frac{1}{72}"),  # one digit then a brace: only the first is braced
        (r"\frac{72}1", r"\frac{72}1"),  # a braced numerator is left alone
        (r"\frac1", r"\frac1"),  # under two characters after \frac: unchanged
        ("3/4", r"\frac{3}{4}"),
        ("03/4", "03/4"),  # "03" is not how int 3 prints: unchanged
        ("3/4/5", "3/4/5"),  # two slashes: unchanged
        (r"\$ 1{.5}", r"1{0.5}"),  # "{." gets its 0
        (r"1\text{ m}\text{ s}", None),  # two unit suffixes: verl raises
        (r"2\sqrt", None),  # a trailing \sqrt: verl raises
        ("", ""),
    ],
)
def test_normalize_math(raw: str, expected: str | None) -> None:
    assert normalize_math(raw) == expected


def test_math_equiv_none_handling() -> None:
    assert math_equiv(None, None) is True  # verl: both None are equal
    assert math_equiv("5", None) is False and math_equiv(None, "5") is False
    assert math_equiv(r"1\text{ m}\text{ s}", r"1\text{ m}\text{ s}") is True  # raw fallback


def test_math_verify_runs_off_the_main_thread() -> None:
    """math-verify's own timeouts use SIGALRM, which fails off the main thread; rlake's scorer does not."""
    import math_verify

    results, errors = [], []

    def work() -> None:
        try:
            results.append(score_math(r"\boxed{0.5}", r"\frac{1}{2}", math_method="math_verify"))
            math_verify.parse(r"\boxed{1}")  # the package's default: signal-based timeout
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert results == [1.0]
    assert len(errors) == 1 and "threaded environment" in str(errors[0])  # why rlake turns them off


def test_scorer_process_times_out_kills_and_restarts() -> None:
    proc = ScorerProcess()
    try:
        assert proc.call(abs, -3, timeout_s=60) == 3
        start = time.monotonic()
        with pytest.raises(RewardTimeout, match=r"sleep ran over 0.5 s; its process was killed"):
            proc.call(time.sleep, 60, timeout_s=0.5)
        assert time.monotonic() - start < 10
        assert proc.call(abs, -4, timeout_s=60) == 4  # a fresh child
        with pytest.raises(RuntimeError, match=r"max failed in the scoring process: ValueError"):
            proc.call(max, [], timeout_s=60)
    finally:
        proc.stop()


def test_missing_math_verify_says_what_why_and_fix(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
    fix = r"pip install 'rlake\[math\]'` \(or `bash scripts/install.sh math`\)"
    with pytest.raises(
        ModuleNotFoundError, match=r"reward.math_method='math_verify' needs the math-verify package.*" + fix
    ):
        require_math_verify()
    rows = _math_rollouts([r"\boxed{3}"])
    with pytest.raises(ModuleNotFoundError, match="needs the math-verify package"):
        score_rollouts(rows, RewardConfig(math_method="math_verify"), use_ray=False)
    assert score_rollouts(rows, RewardConfig(), use_ray=False)["reward"].tolist() == [1.0]  # default needs none


def _math_rollouts(texts: list[str], source: str = "lighteval/MATH") -> pd.DataFrame:
    return pd.DataFrame(
        {
            "rollout_id": range(len(texts)),
            "data_source": [source] * len(texts),
            "response_text": texts,
            "ground_truth": ["3"] * len(texts),
        }
    )


def test_reward_stage_passes_math_method_to_the_math_scorer() -> None:
    texts = [r"\boxed{3.0}", r"\boxed{3}", r"\boxed{4}"]  # 3.0: string-wrong, numerically right
    assert RewardStage()(_math_rollouts(texts))["reward"].tolist() == [0.0, 1.0, 0.0]
    assert RewardStage(math_method="math_verify")(_math_rollouts(texts))["reward"].tolist() == [1.0, 1.0, 0.0]
    scored = score_rollouts(_math_rollouts(texts), RewardConfig(math_method="math_verify"), use_ray=False)
    assert scored["reward"].tolist() == [1.0, 1.0, 0.0]
    gsm = RewardStage(math_method="math_verify")(_math_rollouts(["#### 3"], "openai/gsm8k"))
    assert gsm["reward"].tolist() == [1.0]  # gsm8k scorers take no math_method


@pytest.mark.ray
def test_math_verify_through_ray_tasks(ray_session) -> None:
    texts = [rf"\boxed{{{i % 4}.0}}" for i in range(8)]  # 3.0 is right under math_verify only
    out = score_rollouts(_math_rollouts(texts), RewardConfig(math_method="math_verify", num_workers=2))
    assert out["reward"].tolist() == [1.0 if i % 4 == 3 else 0.0 for i in range(8)]
    assert out["reward_error"].isna().all()
