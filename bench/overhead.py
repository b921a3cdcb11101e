"""Where an RL iteration's wall time goes: per stage, Dagster step wall time vs the stage's own time vs compute.

    python bench/overhead.py                                  # tiny_cpu, 6 iterations, in a temp dir
    python bench/overhead.py --config configs/ci_tiny.yaml --steps 4 --json out.json

Runs `rlake train` in-process (pipelines.runner.run_training) on a fresh output directory, then reads, for every
iteration after the first (iteration 0 starts the worker processes):
- from the run's Dagster event log and run record: the iteration run's wall time (RUN_START -> RUN_SUCCESS), the
  same from the run's creation (its planned-materialization events come before RUN_START) and each asset step's
  (STEP_START -> STEP_SUCCESS);
- from the iteration_metrics table: each stage's own time (`timing_s/<stage>`, measured inside the asset around
  the stage call), the validation's (`timing_s/testing`, iterations that validate: every trainer.test_freq-th
  and the last) and the compute the stages report (`timing_s/update_compute`: the PPO loop);
and prints markdown tables in one run: per stage the mean and median over iterations of step wall, stage time,
and step wall minus stage time (the asset's reads, Delta writes, metadata and Dagster's step machinery); for the
whole iteration the run wall, its parts and the stage times; and the overhead ratio, 1 - work / run wall with
work = timing_s/step + timing_s/testing, as the ratio of the means and the median over iterations (and, for
comparison with measurements before timing_s/testing existed, 1 - timing_s/step / run wall, which counts a
validation as overhead). Measurement only: it changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _step_walls(instance, dagster_run_id: str) -> tuple[float, dict[str, float]]:
    """(run wall s, {asset step: wall s}) from one Dagster run's event log."""
    starts, walls, run = {}, {}, {}
    for entry in instance.all_logs(dagster_run_id):
        ev = entry.dagster_event
        if ev is None:
            continue
        kind = ev.event_type_value
        if kind in ("PIPELINE_START", "RUN_START"):
            run["start"] = entry.timestamp
        elif kind in ("PIPELINE_SUCCESS", "RUN_SUCCESS"):
            run["end"] = entry.timestamp
        elif kind == "STEP_START":
            starts[ev.step_key] = entry.timestamp
        elif kind == "STEP_SUCCESS" and ev.step_key in starts:
            walls[ev.step_key] = entry.timestamp - starts[ev.step_key]
    return run.get("end", 0.0) - run.get("start", 0.0), walls


def measure(config: str, steps: int, overrides: list[str]) -> dict:
    """Train `steps` iterations of `config` in a temp dir; per-iteration step walls and stage times."""
    import dagster as dg
    from deltalake import DeltaTable

    from pipelines.runner import run_training

    out = Path(tempfile.mkdtemp(prefix="rlake-overhead-"))
    os.environ["DAGSTER_HOME"] = str(out / "dagster_home")
    t0 = time.perf_counter()
    res = run_training(
        config, [f"trainer.output_dir={out}", f"trainer.total_training_steps={steps}", *overrides], log=lambda s: None
    )
    total = time.perf_counter() - t0
    instance = dg.DagsterInstance.get()
    runs = instance.get_runs(filters=dg.RunsFilter(tags={"rlake/run_id": res["run_id"]}))
    metrics = DeltaTable(str(out / "tables" / "iteration_metrics")).to_pandas()
    per_iteration = {}
    for run in runs:
        partition = run.tags.get("dagster/partition/iteration")
        if partition is None:
            continue  # the set-up run (partition: the run id alone)
        it = int(partition)
        wall, steps_wall = _step_walls(instance, run.run_id)
        record = instance.get_run_record_by_id(run.run_id)
        m = metrics[(metrics["run_id"] == res["run_id"]) & (metrics["iteration"] == it)]
        timing = {r.metric: float(r.value) for r in m.itertuples() if r.metric.startswith("timing_s/")}
        per_iteration[it] = {
            "run_wall_s": wall,
            # the run's creation (its planned-materialization events) happens before RUN_START
            "created_wall_s": (record.end_time or 0.0) - record.create_timestamp.timestamp(),
            "step_wall_s": steps_wall,
            "timing": timing,
        }
    return {"config": config, "steps": steps, "total_s": total, "output_dir": str(out), "iterations": per_iteration}


TIMING_OF_STEP = {
    "prompt_batches": "timing_s/prompt_batch",
    "policy_checkpoint": "timing_s/update",
    "iteration_metrics": "timing_s/testing",  # validation (every test_freq-th and the last iteration): 0 otherwise
}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def stage_rows(its: list[dict]) -> list[str]:
    """Per Dagster step: mean and median of step wall, stage time, and their difference over iterations."""
    wall, stage = defaultdict(list), defaultdict(list)
    for v in its:
        for step, s in v["step_wall_s"].items():
            wall[step].append(s)
            key = TIMING_OF_STEP.get(step, f"timing_s/{step}")
            stage[step].append(v["timing"].get(key, 0.0 if key == "timing_s/testing" else float("nan")))
    lines = [
        "| stage (Dagster step) | step wall s mean | median | stage time s mean (timing_s) | median "
        "| step wall - stage time s mean | median |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for step in sorted(wall, key=lambda k: -_mean(wall[k])):
        diff = [w - s for w, s in zip(wall[step], stage[step], strict=True)]
        cells = [_mean(wall[step]), _median(wall[step]), _mean(stage[step]), _median(stage[step])]
        cells += [_mean(diff), _median(diff)]
        lines.append(f"| {step} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return lines


def iteration_rows(its: list[dict]) -> list[str]:
    """The whole iteration: run wall, its parts, stage time and the overhead ratios (mean and median)."""

    def col(f) -> tuple[float, float]:
        xs = [f(v) for v in its]
        return _mean(xs), _median(xs)

    run_wall = lambda v: v["run_wall_s"]  # noqa: E731 - one-line accessors of one iteration's measurements
    created_wall = lambda v: v["created_wall_s"]  # noqa: E731
    steps_wall = lambda v: sum(v["step_wall_s"].values())  # noqa: E731
    stage = lambda v: v["timing"].get("timing_s/step", float("nan"))  # noqa: E731
    testing = lambda v: v["timing"].get("timing_s/testing", 0.0)  # noqa: E731
    work = lambda v: stage(v) + testing(v)  # noqa: E731
    rows = [
        ("Dagster run wall (RUN_START -> RUN_SUCCESS)", col(run_wall)),
        ("iteration wall (run created -> RUN_SUCCESS: + the run's creation)", col(created_wall)),
        ("sum of step walls", col(steps_wall)),
        ("outside any step (run start-up, teardown, between steps)", col(lambda v: run_wall(v) - steps_wall(v))),
        ("sum of stage times (timing_s/step)", col(stage)),
        ("validation (timing_s/testing; 0 in iterations without)", col(testing)),
        (
            "of which the PPO loop (timing_s/update_compute)",
            col(lambda v: v["timing"].get("timing_s/update_compute", float("nan"))),
        ),
    ]
    lines = ["| whole iteration | mean s | median s |", "|---|---:|---:|"]
    lines += [f"| {name} | {m:.3f} | {md:.3f} |" for name, (m, md) in rows]
    ratios = [
        ("**overhead ratio** 1 - (timing_s/step + timing_s/testing) / run wall", work, run_wall),
        ("the same of the iteration wall (run creation included)", work, created_wall),
        ("1 - timing_s/step / run wall (validation counted as overhead, as before timing_s/testing)", stage, run_wall),
    ]
    lines += ["", "| overhead ratio | of the means | median over iterations |", "|---|---:|---:|"]
    for name, num, den in ratios:
        of_means = 1 - _mean([num(v) for v in its]) / _mean([den(v) for v in its])
        lines.append(f"| {name} | {of_means:.0%} | {_median([1 - num(v) / den(v) for v in its]):.0%} |")
    return lines


def summarize(result: dict) -> str:
    """The markdown tables over iterations 1.. (iteration 0 starts the workers)."""
    its = [v for k, v in sorted(result["iterations"].items()) if k > 0] or list(result["iterations"].values())
    head = (
        f"{result['config']}, {result['steps']} iterations ({len(its)} measured: iteration 0 starts the workers), "
        f"whole command {result['total_s']:.0f} s"
    )
    return "\n".join([head, "", *stage_rows(its), "", *iteration_rows(its)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=None, help="also write the raw measurements here")
    ap.add_argument("override", nargs="*", help="key.sub=value config overrides")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = measure(args.config, args.steps, args.override)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(summarize(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
