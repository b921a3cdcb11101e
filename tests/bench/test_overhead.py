"""bench/overhead.py's tables from measured iterations: per stage step wall vs stage time (mean, median), the
whole iteration and the overhead ratio, validation (timing_s/testing) counted as work. (The measurement itself
trains tiny_cpu for minutes: docs/benchmarks.md has its output.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("overhead", ROOT / "bench" / "overhead.py")
overhead = sys.modules.setdefault("overhead", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(overhead)


def _iteration(run_wall: float, steps: dict[str, float], timing: dict[str, float]) -> dict:
    return {"run_wall_s": run_wall, "created_wall_s": run_wall + 0.1, "step_wall_s": steps, "timing": timing}


def test_summary_counts_validation_as_work_and_skips_iteration_zero() -> None:
    plain = {"timing_s/step": 1.5, "timing_s/prompt_batch": 0.5, "timing_s/update": 1.0}
    result = {
        "config": "c.yaml",
        "steps": 3,
        "total_s": 9.0,
        "iterations": {
            0: _iteration(100.0, {"prompt_batches": 99.0}, {"timing_s/step": 99.0}),  # starts the workers: left out
            1: _iteration(2.0, {"prompt_batches": 0.6, "policy_checkpoint": 1.1, "iteration_metrics": 0.2}, plain),
            2: _iteration(
                4.0,
                {"prompt_batches": 0.6, "policy_checkpoint": 1.1, "iteration_metrics": 2.2},
                {**plain, "timing_s/testing": 2.0},
            ),
        },
    }
    text = overhead.summarize(result)
    assert "(2 measured: iteration 0 starts the workers)" in text
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("|")}
    # iteration_metrics: 0.2 s of step, no stage time; then 2.2 s with 2.0 s of validation
    assert rows["iteration_metrics"] == "| iteration_metrics | 1.200 | 1.200 | 1.000 | 1.000 | 0.200 | 0.200 |"
    assert rows["prompt_batches"].startswith("| prompt_batches | 0.600 | 0.600 | 0.500 | 0.500 | 0.100 |")
    # work: 1.5 and 3.5 s of 2 and 4 s -> 1 - 2.5 / 3 = 17% of the means, median of 25% and 12.5%
    headline = next(line for name, line in rows.items() if name.startswith("**overhead ratio**"))
    assert headline.endswith("| 17% | 19% |")
    old = next(line for name, line in rows.items() if name.startswith("1 - timing_s/step / run wall"))
    assert old.endswith("| 50% | 44% |")  # 1 - 1.5 / 3; median of 25% and 62.5%
