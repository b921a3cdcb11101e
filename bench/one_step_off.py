"""One-step-off vs synchronous training: per-iteration wall time, whole-process time and the reward curve.

    python bench/one_step_off.py                                   # tiny_cpu, 10 iterations per mode
    python bench/one_step_off.py --config configs/smollm2_gsm8k_cpu.yaml --steps 10 --json out.json

For each of trainer.async_mode=sync and one_step_off, a fresh Python process runs `rlake train` in-process
(pipelines.runner.run_training) on its own output directory with the same config and seed, one mode after the
other (never both at once). Each reports its whole-process wall time (interpreter start to exit), `rlake train`'s
wall time, each iteration's wall time as `rlake train` prints it (in one_step_off: the training run of iteration i
plus waiting for the generation of i+1 beside it; the first generation is outside every iteration), and per
iteration the training reward (critic/score/mean) and the greedy validation reward where the iteration
validated. Then a markdown table of both, side by side. Measurement only: it changes nothing.

`--modes one_step_off` runs one mode alone (a 10-iteration SmolLM2 pair takes about 70 minutes on an AMD EPYC
with AVX-512 and about 4 hours with AVX2 only); each result names the CPU it ran on, and only results from one
kind of CPU (model and vector instructions) compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("sync", "one_step_off")
VAL = "val-core/rlake/arith/reward/mean@1"


def run_mode(config: str, mode: str, steps: int, out_dir: str, overrides: list[str]) -> dict:
    """Train `steps` iterations of `config` with trainer.async_mode=`mode` in this process; what it measured."""
    from pipelines.progress import RunProgress
    from pipelines.runner import run_training
    from stages.run.machine import cpu_description

    class Timed(RunProgress):
        def __init__(self) -> None:
            super().__init__(live=False, log=lambda s: None)
            self.walls: list[float] = []

        def iteration_done(self, it: int, seconds: float, summary: str) -> None:
            self.walls.append(seconds)
            super().iteration_done(it, seconds, summary)

    progress = Timed()
    sets = [f"trainer.async_mode={mode}", f"trainer.output_dir={out_dir}", "trainer.resume_mode=disable", *overrides]
    t0 = time.perf_counter()
    res = run_training(config, sets, steps=steps, progress=progress)
    train_s = time.perf_counter() - t0
    rows = res["iterations"]
    return {
        "mode": mode,
        "cpu": cpu_description(),
        "train_s": train_s,
        "iteration_s": progress.walls,
        "reward": [float(r.get("critic/score/mean", float("nan"))) for r in rows],
        "val": [_val(r) for r in rows],
        "setup_val": _val(res["setup"]),
        "timing_step_s": [float(r.get("timing_s/step", float("nan"))) for r in rows],
        "timing_testing_s": testing_seconds(out_dir, len(rows)),
    }


def testing_seconds(out_dir: str, n: int) -> list[float]:
    """timing_s/testing (the validation's seconds, 0 where the iteration did not validate) of iterations 0..n-1,
    from the run's iteration_metrics table (the materialization metadata does not carry it)."""
    from deltalake import DeltaTable

    df = DeltaTable(str(Path(out_dir) / "tables" / "iteration_metrics")).to_pandas(
        columns=["iteration", "metric", "value"]
    )
    got = df[df["metric"] == "timing_s/testing"].groupby("iteration")["value"].last()
    return [float(got.get(i, 0.0)) for i in range(n)]


def _val(meta: dict) -> float | None:
    """The greedy validation reward of a metadata dict: the key ending in reward/mean@1 under val-core."""
    for k, v in meta.items():
        if k.startswith("val-core/") and k.endswith("reward/mean@1"):
            return float(v)
    return None


def measure(config: str, steps: int, overrides: list[str], workdir: str, modes=MODES) -> list[dict]:
    """Each of `modes`, one fresh process each, one after the other."""
    results = []
    for mode in modes:
        out = Path(workdir) / mode
        dump = Path(workdir) / f"{mode}.json"
        cmd = [sys.executable, __file__, "--one", mode, "--config", config, "--steps", str(steps)]
        cmd += ["--out-dir", str(out), "--json", str(dump), *[a for o in overrides for a in ("--set", o)]]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        results.append({**json.loads(dump.read_text()), "process_s": time.perf_counter() - t0})
    return results


def table(results: list[dict]) -> str:
    """Markdown: per iteration wall time and rewards of each mode, then the totals."""
    head = "| iteration | " + " | ".join(f"{r['mode']} s | {r['mode']} reward | {r['mode']} val" for r in results)
    lines = [head + " |", "|---" * (1 + 3 * len(results)) + "|"]
    for i in range(max(len(r["iteration_s"]) for r in results)):
        cells = []
        for r in results:
            val = r["val"][i] if i < len(r["val"]) else None
            cells += [f"{r['iteration_s'][i]:.1f}", f"{r['reward'][i]:.3f}", "" if val is None else f"{val:.3f}"]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    lines += ["", "| | " + " | ".join(r["mode"] for r in results) + " |", "|---" * (1 + len(results)) + "|"]
    rows = {
        "mean iteration s (after the first)": lambda r: statistics.mean(r["iteration_s"][1:] or r["iteration_s"]),
        "median iteration s (after the first)": lambda r: statistics.median(r["iteration_s"][1:] or r["iteration_s"]),
        "rlake train s": lambda r: r["train_s"],
        "whole process s": lambda r: r["process_s"],
        "mean training reward": lambda r: statistics.mean(r["reward"]),
        "last greedy val": lambda r: next((v for v in reversed(r["val"]) if v is not None), float("nan")),
    }
    for name, fn in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{fn(r):.3f}" for r in results) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], help="a config override for both modes (key=value)")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the modes to run (default both)")
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.one:
        Path(args.json).write_text(json.dumps(run_mode(args.config, args.one, args.steps, args.out_dir, args.set)))
        return
    with tempfile.TemporaryDirectory(prefix="rlake-one-step-off-") as tmp:
        results = measure(args.config, args.steps, args.set, tmp, args.modes)
    print("CPU: " + "; ".join(sorted({r["cpu"] for r in results})))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
