"""The `rlake` command line: train, ui, lineage, sql."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _quiet_env() -> None:
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                       "TOKENIZERS_PARALLELISM": "false", "RAY_ACCEPT_CLOUD_SDK_WARNING": "1",
                       "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "RAY_TRAIN_V2_ENABLED": "1",
                       "RAY_DEDUP_LOGS": "1", "PYTHONWARNINGS": "ignore"}.items():
        os.environ.setdefault(key, value)
    import logging

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("ray").setLevel(logging.WARNING)


def cmd_train(args: argparse.Namespace) -> int:
    _quiet_env()
    from pipelines.runner import run_training

    run_training(args.config, list(args.override), run_id=args.run_id, steps=args.steps)
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

    from stages.sql import query

    versions = {}
    for item in args.version:
        name, _, v = item.partition("=")
        if not v.isdigit():
            raise SystemExit(f"--version expects TABLE=N, got '{item}'")
        versions[name] = int(v)
    with pd.option_context("display.max_rows", args.limit, "display.max_columns", 50, "display.width", 200,
                           "display.max_colwidth", 60):
        print(query(_tables_root(args), args.query, versions).head(args.limit).to_string(index=False))
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    import json

    from stages.store import commit_lineage

    uri = _tables_root(args) / args.table
    for entry in commit_lineage(str(uri), run_id=args.run_id, iteration=args.iteration):
        print(json.dumps(entry, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlake", description="RL post-training of LLMs as a data pipeline.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="run the RL iterations through Dagster in-process")
    t.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    t.add_argument("--run-id", default=None, help="rlake run id (default: experiment_name-timestamp)")
    t.add_argument("--steps", type=int, default=None, help="override trainer.total_training_steps for this call")
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
    q.add_argument("--version", action="append", default=[], help="time travel: TABLE=N (repeatable)")
    q.add_argument("--limit", type=int, default=50)
    q.set_defaults(fn=cmd_sql)
    li = sub.add_parser("lineage", help="commit lineage of a table (run, iteration, policy, config, upstream versions)")
    li.add_argument("table")
    li.add_argument("--iteration", type=int, default=None)
    li.add_argument("--run-id", default=None)
    li.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    li.add_argument("--tables", default=None)
    li.set_defaults(fn=cmd_lineage)
    return p


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValidationError, FileNotFoundError, ValueError) as exc:
        if os.environ.get("RLAKE_DEBUG"):
            raise
        print(f"rlake {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
