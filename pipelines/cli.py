"""The `rlake` command line: train, ui, lineage, sql."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
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


def dagster_home(output_dir: str) -> Path:
    """DAGSTER_HOME if set, else <output_dir>/dagster_home (created), so `rlake ui` shows `rlake train`'s runs."""
    home = Path(os.environ.get("DAGSTER_HOME") or Path(output_dir).resolve() / "dagster_home")
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").touch()
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def cmd_train(args: argparse.Namespace) -> int:
    _quiet_env()
    from configs.schema import load_config

    overrides = list(args.override)
    cfg = load_config(args.config, overrides)  # fails here, before any work, on a bad config
    run_id = args.run_id or cfg.trainer.run_id or f"{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides.append(f"trainer.run_id={run_id}")
    cfg = load_config(args.config, overrides)
    dagster_home(cfg.trainer.output_dir)
    import dagster as dg

    from pipelines.definitions import build_definitions
    from pipelines.jobs import ITERATION_JOB, SETUP_JOB

    defs = build_definitions(args.config, overrides)
    instance = dg.DagsterInstance.get()
    print(f"rlake run {run_id}  config {args.config}  hash {cfg.config_hash()}  output {Path(cfg.trainer.output_dir).resolve()}")
    t0 = time.perf_counter()
    result = defs.get_job_def(SETUP_JOB).execute_in_process(instance=instance, tags={"rlake/run_id": run_id})
    print(f"setup done in {time.perf_counter() - t0:.1f}s: {_val_summary(result, 'initial_policy')}")
    steps = args.steps if args.steps is not None else cfg.trainer.total_training_steps
    for it in range(steps):
        t1 = time.perf_counter()
        instance.add_dynamic_partitions("iteration", [str(it)])
        res = defs.get_job_def(ITERATION_JOB).execute_in_process(partition_key=str(it), instance=instance,
                                                                 tags={"rlake/run_id": run_id})
        meta = _metadata(res, "iteration_metrics")
        line = "  ".join(f"{k}={_fmt(meta[k])}" for k in sorted(meta) if k != "delta_version")
        print(f"iteration {it}: {time.perf_counter() - t1:.1f}s  {line}", flush=True)
    print(f"done: {steps} iterations in {time.perf_counter() - t0:.1f}s. Tables: {Path(cfg.trainer.output_dir).resolve() / 'tables'}; "
          f"MLflow: {defs.resources['tracker'].tracking_uri} (experiment {cfg.trainer.project_name}, run {run_id})")
    return 0


def _metadata(result, asset: str) -> dict:
    for event in result.get_asset_materialization_events():
        mat = event.step_materialization_data.materialization
        if mat.asset_key.to_user_string() == asset:
            return {k: v.value for k, v in mat.metadata.items()}
    return {}


def _val_summary(result, asset: str) -> str:
    meta = _metadata(result, asset)
    return "  ".join(f"{k}={_fmt(v)}" for k, v in sorted(meta.items()) if k.startswith("val"))


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def cmd_ui(args: argparse.Namespace) -> int:
    from configs.schema import load_config

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
