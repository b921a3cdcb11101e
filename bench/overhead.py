"""Where an RL iteration's wall time goes: per stage, Dagster step wall time vs the stage's own time vs compute.

    python bench/overhead.py                                  # tiny_cpu, 6 iterations, in a temp dir
    python bench/overhead.py --config configs/ci_tiny.yaml --steps 4 --json out.json

Runs `rlake train` in-process (pipelines.runner.run_training) on a fresh output directory, then reads, for every
iteration after the first (iteration 0 starts the worker processes):
- from the run's Dagster event log: the iteration run's wall time (RUN_START -> RUN_SUCCESS) and each asset
  step's (STEP_START -> STEP_SUCCESS);
- from the iteration_metrics table: each stage's own time (`timing_s/<stage>`, measured inside the asset around
  the stage call) and the compute the stages report (`timing_s/update_compute`: the PPO loop);
and prints one markdown table: per stage the means of step wall, stage time, and step wall minus stage time
(the asset's reads, Delta writes, metadata and Dagster's step machinery), and for the whole iteration the
run wall, the sum of stage times (`timing_s/step`), the time outside any step (run start-up and teardown,
between steps) and the overhead ratio 1 - timing_s/step / run wall. Measurement only: it changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
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
        m = metrics[(metrics["run_id"] == res["run_id"]) & (metrics["iteration"] == it)]
        timing = {r.metric: float(r.value) for r in m.itertuples() if r.metric.startswith("timing_s/")}
        per_iteration[it] = {"run_wall_s": wall, "step_wall_s": steps_wall, "timing": timing}
    return {"config": config, "steps": steps, "total_s": total, "output_dir": str(out), "iterations": per_iteration}


TIMING_OF_STEP = {"prompt_batches": "timing_s/prompt_batch", "policy_checkpoint": "timing_s/update"}


def summarize(result: dict) -> str:
    """The markdown table over iterations 1.. (iteration 0 starts the workers)."""
    its = [v for k, v in sorted(result["iterations"].items()) if k > 0] or list(result["iterations"].values())
    wall, stage = defaultdict(list), defaultdict(list)
    for v in its:
        for step, s in v["step_wall_s"].items():
            wall[step].append(s)
            stage[step].append(v["timing"].get(TIMING_OF_STEP.get(step, f"timing_s/{step}"), float("nan")))
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731 - a one-line helper
    lines = [
        f"{result['config']}, {result['steps']} iterations ({len(its)} measured: iteration 0 starts the workers), "
        f"whole command {result['total_s']:.0f} s",
        "",
        "| stage (Dagster step) | step wall s | stage time s (timing_s) | step wall - stage time s |",
        "|---|---:|---:|---:|",
    ]
    for step in sorted(wall, key=lambda k: -mean(wall[k])):
        w, s = mean(wall[step]), mean(stage[step])
        lines.append(f"| {step} | {w:.3f} | {s:.3f} | {w - s:.3f} |")
    run_wall = mean([v["run_wall_s"] for v in its])
    step_sum = mean([sum(v["step_wall_s"].values()) for v in its])
    stage_sum = mean([v["timing"].get("timing_s/step", float("nan")) for v in its])
    compute = mean([v["timing"].get("timing_s/update_compute", float("nan")) for v in its])
    lines += [
        "",
        "| whole iteration | s |",
        "|---|---:|",
        f"| Dagster run wall (RUN_START -> RUN_SUCCESS) | {run_wall:.3f} |",
        f"| sum of step walls | {step_sum:.3f} |",
        f"| outside any step (run start-up, teardown, between steps) | {run_wall - step_sum:.3f} |",
        f"| sum of stage times (timing_s/step) | {stage_sum:.3f} |",
        f"| of which the PPO loop (timing_s/update_compute) | {compute:.3f} |",
        f"| **overhead ratio** 1 - timing_s/step / run wall | **{1 - stage_sum / run_wall:.0%}** |",
    ]
    return "\n".join(lines)


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
