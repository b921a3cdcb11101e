"""The `rlake` command line: train, ui, lineage, sql, replay, compare, export, plot."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _quiet_env() -> None:
    from pipelines.logs import quiet_env

    quiet_env()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def cmd_train(args: argparse.Namespace) -> int:
    """Framework logs go to <output_dir>/logs/train-<time>.log (--verbose: also stderr); a live display shows progress."""
    import time

    from configs.schema import load_config
    from pipelines.logs import route_framework_logs
    from pipelines.progress import RunProgress
    from pipelines.runner import run_training

    from pydantic import ValidationError

    from stages.run.preflight import explain_config_error

    try:
        out = Path(load_config(args.config, list(args.override)).trainer.output_dir).resolve()
    except ValidationError as exc:
        raise explain_config_error(exc) from None
    _quiet_env()
    log_file = route_framework_logs(out / "logs" / f"train-{time.strftime('%Y%m%d-%H%M%S')}.log", verbose=args.verbose)
    with RunProgress().verbose_steps(args.verbose) as progress:
        progress.line(f"framework logs (Ray, Dagster, MLflow, warnings): {log_file}")
        run_training(args.config, list(args.override), run_id=args.run_id, steps=args.steps, progress=progress)
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    from configs.schema import load_config
    from pipelines.runner import dagster_home

    cfg = load_config(args.config)
    env = {**os.environ, "RLAKE_CONFIG": str(Path(args.config).resolve()), "DAGSTER_HOME": str(dagster_home(cfg.trainer.output_dir))}
    cmd = [sys.executable, "-m", "dagster", "dev", "-w", str(ROOT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(args.port)]
    print("starting:", " ".join(cmd), f"(DAGSTER_HOME={env['DAGSTER_HOME']})")
    return subprocess.call(cmd, env=env, cwd=os.getcwd())


def _tables_root(args: argparse.Namespace) -> Path:
    if args.tables:
        return Path(args.tables)
    from configs.schema import load_config

    return Path(load_config(args.config).trainer.output_dir).resolve() / "tables"


def cmd_sql(args: argparse.Namespace) -> int:
    import pandas as pd

    from stages.io.sql import query

    versions = {}
    for item in args.version:
        name, _, v = item.partition("=")
        if not v.isdigit():
            raise ValueError(f"--version expects TABLE=N or ALIAS:TABLE=N, got '{item}'")
        versions[name] = int(v)
    with pd.option_context("display.max_rows", args.limit, "display.max_columns", 50, "display.width", 200,
                           "display.max_colwidth", 60):
        print(query(_tables_root(args), args.query, versions).head(args.limit).to_string(index=False))
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    import json

    from stages.io.store import commit_lineage

    uri = _tables_root(args) / args.table
    for entry in commit_lineage(str(uri), run_id=args.run_id, iteration=args.iteration):
        print(json.dumps(entry, default=str))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    _quiet_env()
    from configs.schema import load_config
    from stages.run.replay import replay_update

    cfg = load_config(args.config, [*args.override, f"trainer.run_id={args.run_id}"])
    scratch = Path(args.scratch or Path(cfg.trainer.output_dir) / "replay" / args.run_id / f"iteration_{args.iteration}")
    try:
        report = replay_update(cfg, args.iteration, scratch, rtol=args.rtol)
    except LookupError as exc:
        print(f"rlake replay: error: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    return 0 if report.passed else 1


def cmd_export(args: argparse.Namespace) -> int:
    _quiet_env()
    import json

    from stages.run.export import export_policy, resolve_checkpoint

    out_dir = None
    if args.checkpoint is None:
        from configs.schema import load_config

        out_dir = str(Path(load_config(args.config).trainer.output_dir).resolve())
    src = resolve_checkpoint(args.checkpoint, output_dir=out_dir, run_id=args.run_id, version=args.version)
    print(json.dumps(export_policy(src, args.out, overwrite=args.overwrite), indent=1))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from stages.run.compare import compare_runs, format_comparison

    uri = args.tracking_uri
    if uri is None:
        from configs.schema import load_config

        cfg = load_config(args.config)
        uri = cfg.trainer.mlflow_tracking_uri or f"sqlite:///{Path(cfg.trainer.output_dir).resolve() / 'mlflow.db'}"
    prefixes = tuple(p.strip() for p in args.metrics.split(",") if p.strip())
    print(format_comparison(compare_runs(uri, args.run_a, args.run_b, experiment=args.experiment,
                                         metric_prefixes=prefixes)), end="")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from stages.io.plots import load_run_metrics, run_figure, save_png

    tables = _tables_root(args)
    try:
        df = load_run_metrics(tables, args.run)
    except LookupError as exc:
        print(f"rlake plot: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else tables.parent / "plots" / f"{args.run}.png"
    print(f"wrote {save_png(run_figure(df, f'run {args.run}'), out)}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config (bases, overrides and verl names applied) and its hash."""
    import yaml
    from pydantic import ValidationError

    from configs.compose import flatten, yaml_scalar
    from configs.schema import load_config
    from stages.run.preflight import explain_config_error

    try:
        cfg = load_config(args.config, list(args.override))
    except ValidationError as exc:
        raise explain_config_error(exc) from None
    tree = cfg.model_dump(mode="json")
    if args.yaml:
        print(yaml.safe_dump(tree, sort_keys=False), end="")
    else:
        print("\n".join(f"{key}: {yaml_scalar(value)}" for key, value in flatten(tree).items()))
    print(f"# config hash: {cfg.config_hash()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlake", description="RL post-training of LLMs as a data pipeline.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="run the RL iterations through Dagster in-process")
    t.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    t.add_argument("--run-id", default=None, help="rlake run id (default: experiment_name-timestamp)")
    t.add_argument("--steps", type=int, default=None, help="override trainer.total_training_steps for this call")
    t.add_argument("--verbose", action="store_true", help="also print Ray/Dagster/MLflow logs and warnings to stderr")
    t.add_argument("override", nargs="*", help="key.sub=value config overrides")
    t.set_defaults(fn=cmd_train)
    u = sub.add_parser("ui", help="start Dagster's webserver on 127.0.0.1")
    u.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    u.add_argument("--port", type=int, default=3000)
    u.set_defaults(fn=cmd_ui)
    q = sub.add_parser("sql", help="SQL (DuckDB) over every Delta table: prompts, rollouts, scored_rollouts, ...")
    q.add_argument("query")
    q.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"), help="locates output_dir/tables")
    q.add_argument("--tables", default=None, help="tables directory (overrides --config)")
    q.add_argument("--version", action="append", default=[], help="time travel: TABLE=N, or ALIAS:TABLE=N to add view ALIAS of TABLE at version N (repeatable)")
    q.add_argument("--limit", type=int, default=50)
    q.set_defaults(fn=cmd_sql)
    li = sub.add_parser("lineage", help="commit lineage of a table (run, iteration, policy, config, upstream versions)")
    li.add_argument("table")
    li.add_argument("--iteration", type=int, default=None)
    li.add_argument("--run-id", default=None)
    li.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    li.add_argument("--tables", default=None)
    li.set_defaults(fn=cmd_lineage)
    r = sub.add_parser("replay", help="re-run a stored iteration's policy update from its tables and compare to the logged metrics",
                       description="Re-runs iteration N's policy update from the advantages version its lineage recorded, "
                                   "starting from the stored policy_vN (kept by trainer.save_freq), into a scratch "
                                   "directory; compares the update metrics (actor/*) to iteration_metrics and the weights "
                                   "to policy_v(N+1). Exits 1 when a value differs by more than --rtol (relative, plus "
                                   "1e-7 absolute). Measured on CPU with the same worker count: bitwise equal.")
    r.add_argument("--run-id", required=True)
    r.add_argument("--iteration", type=int, required=True)
    r.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"), help="the run's config (same overrides)")
    r.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    r.add_argument("--scratch", default=None, help="where the replayed checkpoint goes (default output_dir/replay/RUN/iteration_N)")
    r.add_argument("override", nargs="*", help="key.sub=value config overrides the run was trained with")
    r.set_defaults(fn=cmd_replay)
    ex = sub.add_parser("export", help="write a plain HF model directory from a policy checkpoint")
    ex.add_argument("--checkpoint", default=None, help="a policy_v<N> checkpoint directory")
    ex.add_argument("--run-id", default=None, help="with --version: output_dir/checkpoints/<run-id>/policy_v<N>")
    ex.add_argument("--version", type=int, default=None)
    ex.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"), help="locates trainer.output_dir")
    ex.add_argument("--out", required=True, help="directory to write (must be new or empty)")
    ex.add_argument("--overwrite", action="store_true")
    ex.set_defaults(fn=cmd_export)
    cp = sub.add_parser("compare", help="two runs side by side from MLflow: params that differ, final/best metrics")
    cp.add_argument("run_a", help="rlake run id (MLflow tag rlake.run_id)")
    cp.add_argument("run_b")
    cp.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"), help="locates the MLflow store")
    cp.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (overrides --config)")
    cp.add_argument("--experiment", default=None, help="only look in this MLflow experiment (trainer.project_name)")
    cp.add_argument("--metrics", default="", help="comma-separated metric name prefixes to show (default: all)")
    cp.set_defaults(fn=cmd_compare)
    pl = sub.add_parser("plot", help="PNG of a run's curves from iteration_metrics: reward, response length, KL, "
                                     "entropy, validation rewards")
    pl.add_argument("run", help="rlake run id")
    pl.add_argument("--out", default=None, help="PNG path (default <output_dir>/plots/<run>.png)")
    pl.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"), help="locates output_dir/tables")
    pl.add_argument("--tables", default=None, help="tables directory (overrides --config)")
    pl.set_defaults(fn=cmd_plot)
    cf = sub.add_parser("config", help="print the resolved config (defaults: bases, overrides applied) and its hash")
    cf.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    cf.add_argument("--yaml", action="store_true", help="nested YAML (a full config file) instead of key.sub: value lines")
    cf.add_argument("override", nargs="*", help="key.sub=value config overrides")
    cf.set_defaults(fn=cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValidationError, FileNotFoundError, FileExistsError, ValueError) as exc:
        if os.environ.get("RLAKE_DEBUG"):
            raise
        print(f"rlake {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
