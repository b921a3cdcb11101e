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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
