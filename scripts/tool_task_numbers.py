"""README numbers of the tool task (issue #21): tool use and reward before and after RL.

    python scripts/tool_task_numbers.py                  # runs `rlake train --config configs/tool_tiny_cpu.yaml`
                                                         # in a new output dir, then prints the tables (markdown)
    python scripts/tool_task_numbers.py --output-dir rlake_output/tools [--run-id ID]   # a finished run's tables

Per training iteration, from the lake (SQL over the Delta tables, stages/io/sql.py): the tool-call rate (share of
rollouts with at least one tool call: a `tool` row in the `turns` table), the tool success rate (share of those
calls the tool answered without an error), the mean reward and the accuracy (share of rollouts whose strict
`#### N` answer is the ground truth, whatever reward.format_score pays) of `scored_rollouts`. Then the held-out
validation of every validated policy version (iteration_metrics: greedy mean@1, sampled mean@n, and the
multi-turn metrics logged with them). `--json FILE` also writes the numbers.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from main_job import environment, metrics_frame, train_or_read

PER_ITERATION_SQL = """
WITH calls AS (
    SELECT iteration, rollout_id, count(*) AS calls, count(*) FILTER (WHERE error IS NULL) AS answered
    FROM turns WHERE run_id = '{run}' AND role = 'tool' GROUP BY iteration, rollout_id
)
SELECT s.iteration, s.rollout_id, s.reward, s.response_text, s.ground_truth,
       coalesce(c.calls, 0) AS calls, coalesce(c.answered, 0) AS answered
FROM scored_rollouts s LEFT JOIN calls c ON s.iteration = c.iteration AND s.rollout_id = c.rollout_id
WHERE s.run_id = '{run}'
"""


def per_iteration(tables: Path, run_id: str):
    """One row per training iteration: rollouts, tool_call_rate, tool_success_rate, reward_mean, accuracy."""
    from stages.data.rewards import extract_gsm8k_answer
    from stages.io.sql import query

    if "'" in run_id:
        raise SystemExit(f"run id {run_id!r} holds a quote; pass the run id as rlake lists it")
    df = query(tables, PER_ITERATION_SQL.format(run=run_id))
    if df.empty:
        raise SystemExit(f"run '{run_id}' has no scored_rollouts under {tables}: did its first iteration finish?")
    df["called"] = df["calls"] > 0
    df["correct"] = [extract_gsm8k_answer(t or "") == str(g) for t, g in zip(df["response_text"], df["ground_truth"])]
    out = df.groupby("iteration").agg(
        rollouts=("rollout_id", "size"),
        tool_call_rate=("called", "mean"),
        calls=("calls", "sum"),
        answered=("answered", "sum"),
        reward_mean=("reward", "mean"),
        accuracy=("correct", "mean"),
    )
    out["tool_success_rate"] = (out["answered"] / out["calls"]).where(out["calls"] > 0)
    return out.drop(columns=["calls", "answered"]).sort_index()


def validation(wide) -> tuple[list[str], dict]:
    """Markdown rows and numbers of the held-out validation per validated policy version."""
    cols = [c for c in wide.columns if c.startswith(("val-core/", "val-aux/"))]
    cols = [c for c in cols if re.search(r"/reward/mean@\d+$", c)]  # the greedy and sampled means
    if not cols:
        return ["The run logged no held-out validation (val-core/... metrics)."], {}
    val = wide[cols].dropna(how="all")
    lines = ["| policy version | " + " | ".join(f"`{c}`" for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    lines += [f"| {int(v)} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |" for v, row in val.iterrows()]
    return lines, {int(v): {c: float(row[c]) for c in cols if row[c] == row[c]} for v, row in val.iterrows()}


def build_tables(tables: Path, run_id: str) -> tuple[str, dict]:
    """The markdown tables and the same numbers as a dict."""
    it = per_iteration(tables, run_id)
    lines = [
        f"Run `{run_id}`: training rollouts per iteration.",
        "",
        "| iteration | rollouts | tool-call rate | tool success rate | mean reward | accuracy |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in it.iterrows():
        success = "-" if r["tool_success_rate"] != r["tool_success_rate"] else f"{r['tool_success_rate']:.3f}"
        lines.append(
            f"| {i} | {int(r['rollouts'])} | {r['tool_call_rate']:.3f} | {success} | "
            f"{r['reward_mean']:.3f} | {r['accuracy']:.3f} |"
        )
    val_lines, val = validation(metrics_frame(tables, run_id))
    lines += ["", "Held-out validation by policy version (0 = the warm start, before RL):", "", *val_lines]
    env = environment()
    lines += [
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items()),
        f"Commit {env['commit']}, {env['date']}, {env['machine']}.",
    ]
    numbers = {
        "run_id": run_id,
        "iterations": {int(i): {k: float(v) for k, v in r.items() if v == v} for i, r in it.iterrows()},
        "validation": val,
        "environment": env,
    }
    return "\n".join(lines), numbers


def main(argv: list[str] | None = None) -> int:
    args, tables, run_id, timings = train_or_read(argv, __doc__, "configs/tool_tiny_cpu.yaml", "rlake-tool-task-")
    text, numbers = build_tables(tables, run_id)
    if timings:
        text += f"\nWall time: {timings['wall_s']:.0f} s for `rlake train --config {args.config}`."
        numbers["timings"] = timings
    print("\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps(numbers, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
