"""The `rlake` command line: train, ui, lineage, sql, replay, rescore, compare, export, plot, config, gc, maintain.

Commands import what they need when they run (`# noqa: PLC0415 - CLI start-up`): `rlake --help` and a
config error stay fast, and the quiet-logging environment (pipelines/logs.py) is set before torch,
transformers, Ray, MLflow and Dagster are first imported, which read it once.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import yaml
from pydantic import ValidationError

from configs.errors import load_run_config
from configs.schema import RunConfig, load_config
from pipelines.logs import quiet_env, report_failure, route_framework_logs

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")


def _quiet_env() -> None:
    quiet_env()
    import transformers  # noqa: PLC0415 - CLI start-up

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _check_reward_file(cfg: RunConfig) -> None:
    """A broken reward.custom_reward_function file (missing, import error, no such function, wrong signature)
    fails here, in about a second: before torch, Ray and Dagster are imported (preflight checks the rest)."""
    quiet_env()  # the reward file runs now: libraries it imports read these once
    from stages.data.custom_reward import check_custom_reward  # noqa: PLC0415 - CLI start-up, standard library only

    check_custom_reward(cfg.reward.custom_reward_function)


def cmd_train(args: argparse.Namespace) -> int:
    """Framework logs go to <output_dir>/logs/train-<time>.log (--verbose: also stderr); a live display shows
    progress. The config is parsed here, once, and passed on as a RunConfig."""
    cfg = load_run_config(args.config, args.override)  # a bad config fails here, before any heavy import
    _check_reward_file(cfg)
    _quiet_env()
    from pipelines.progress import RunProgress  # noqa: PLC0415 - CLI start-up
    from pipelines.runner import run_training  # noqa: PLC0415 - CLI start-up

    out = Path(cfg.trainer.output_dir).resolve()
    log_file = route_framework_logs(out / "logs" / f"train-{time.strftime('%Y%m%d-%H%M%S')}.log", verbose=args.verbose)
    try:
        with RunProgress().verbose_steps(args.verbose) as progress:
            progress.line(f"framework logs (Ray, Dagster, MLflow, warnings): {log_file}")
            progress.phase("config", args.config)
            run_training(cfg, run_id=args.run_id, steps=args.steps, progress=progress)
    except Exception as exc:  # one error line here, the traceback in the log file
        if os.environ.get("RLAKE_DEBUG"):
            raise
        return report_failure("train", exc, log_file)
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    """`dagster dev` on the Dagster home of --config + overrides (--run-dir: trainer.output_dir), stopped cleanly
    on Ctrl-C / SIGTERM (pipelines/ui.py)."""
    from pipelines.ui import serve, ui_overrides  # noqa: PLC0415 - CLI start-up

    return serve(args.config, ui_overrides(args.override, args.run_dir), port=args.port)


def _tables_root(args: argparse.Namespace) -> str:
    """--tables, else <storage.root>/tables of --config and its overrides (default <trainer.output_dir>/tables):
    a storage URI (local or s3://) carrying the config's storage.options when it is remote."""
    from stages.io import uris  # noqa: PLC0415 - CLI start-up

    if args.tables and uris.is_local(args.tables):
        return uris.normalize(args.tables)
    cfg = load_run_config(args.config, args.override)
    root = args.tables or uris.tables_root(cfg)
    return uris.with_options(uris.normalize(root), uris.storage_options(cfg, root))


def cmd_sql(args: argparse.Namespace) -> int:
    import pandas as pd  # noqa: PLC0415 - CLI start-up

    from stages.io.sql import query  # noqa: PLC0415 - CLI start-up

    versions = {}
    for item in args.version:
        name, _, v = item.partition("=")
        if not v.isdigit():
            raise ValueError(f"--version expects TABLE=N or ALIAS:TABLE=N, got '{item}'")
        versions[name] = int(v)
    with pd.option_context(
        "display.max_rows", args.limit, "display.max_columns", 50, "display.width", 200, "display.max_colwidth", 60
    ):
        print(query(_tables_root(args), args.query, versions).head(args.limit).to_string(index=False))
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    from stages.io import uris  # noqa: PLC0415 - CLI start-up
    from stages.io.store import commit_lineage, table_exists  # noqa: PLC0415 - CLI start-up

    uri = uris.join(_tables_root(args), args.table)
    if not table_exists(uri):
        raise FileNotFoundError(
            f"no Delta table '{args.table}' at '{uri}': check the table name (`rlake sql` lists the tables) and "
            "--config / --tables / storage.root=... (where the run's tables are)"
        )
    for entry in commit_lineage(uri, run_id=args.run_id, iteration=args.iteration):
        print(json.dumps(entry, default=str))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    cfg = load_run_config(args.config, [*args.override, f"trainer.run_id={args.run_id}"])
    _quiet_env()
    from stages.run.replay import replay_update  # noqa: PLC0415 - CLI start-up

    scratch = Path(
        args.scratch or Path(cfg.trainer.output_dir) / "replay" / args.run_id / f"iteration_{args.iteration}"
    )
    try:
        report = replay_update(cfg, args.iteration, scratch, rtol=args.rtol)
    except LookupError as exc:
        print(f"rlake replay: error: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    return 0 if report.passed else 1


def cmd_rescore(args: argparse.Namespace) -> int:
    cfg = load_run_config(args.config, [*args.override, f"trainer.run_id={args.run_id}"])
    _check_reward_file(cfg)
    _quiet_env()
    from pipelines.rescore import rescore  # noqa: PLC0415 - CLI start-up
    from stages.run.preflight import preflight  # noqa: PLC0415 - CLI start-up

    preflight(cfg)  # a bad reward (or data) fails here, before Ray or Dagster
    try:
        report = rescore(cfg, args.iteration, advantages=args.advantages)
    except LookupError as exc:
        print(f"rlake rescore: error: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    _quiet_env()
    from stages.run.export import export_policy, resolve_checkpoint  # noqa: PLC0415 - CLI start-up

    cfg = load_run_config(args.config, args.override) if args.checkpoint is None else None
    src = resolve_checkpoint(args.checkpoint, cfg=cfg, run_id=args.run_id, version=args.version)
    print(json.dumps(export_policy(src, args.out, overwrite=args.overwrite), indent=1))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from stages.run.compare import compare_runs, format_comparison  # noqa: PLC0415 - CLI start-up

    uri = args.tracking_uri
    if uri is None:
        cfg = load_config(args.config)
        uri = cfg.trainer.tracking_uri
    prefixes = tuple(p.strip() for p in args.metrics.split(",") if p.strip())
    print(
        format_comparison(
            compare_runs(uri, args.run_a, args.run_b, experiment=args.experiment, metric_prefixes=prefixes)
        ),
        end="",
    )
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from stages.io import uris  # noqa: PLC0415 - CLI start-up
    from stages.io.plots import load_run_metrics, run_figure, save_png  # noqa: PLC0415 - CLI start-up

    tables = _tables_root(args)
    try:
        df = load_run_metrics(tables, args.run)
    except LookupError as exc:
        print(f"rlake plot: error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
    elif uris.is_local(tables):
        out = uris.local_path(tables).parent / "plots" / f"{args.run}.png"
    else:  # remote tables: the plot goes to the local output directory
        cfg = load_run_config(args.config, args.override)
        out = Path(cfg.trainer.output_dir).resolve() / "plots" / f"{args.run}.png"
    print(f"wrote {save_png(run_figure(df, f'run {args.run}'), out)}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config (bases, overrides and verl names applied) and its hash."""
    from configs.compose import flatten, yaml_scalar  # noqa: PLC0415 - CLI start-up

    cfg = load_run_config(args.config, args.override)
    tree = cfg.model_dump(mode="json")
    if args.yaml:
        print(yaml.safe_dump(tree, sort_keys=False), end="")
    else:
        print("\n".join(f"{key}: {yaml_scalar(value)}" for key, value in flatten(tree).items()))
    print(f"# config hash: {cfg.config_hash()}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """Kill a run's Ray workers and remove its placement groups on the cluster at ray.address (after a crash:
    on a cluster they outlive the driver, stages/workers/group.py)."""
    cfg = load_run_config(args.config, args.override)
    if not cfg.ray.is_cluster:
        raise ValueError(
            "rlake gc cleans a run's workers on a Ray cluster, but ray.address is 'local': a local cluster is the "
            "training process's own and ends with it, so there is nothing to collect; pass the cluster's "
            "address, e.g. rlake gc --run-id R ray.address=auto"
        )
    from stages.workers.connect import check_cluster_auth  # noqa: PLC0415 - CLI start-up
    from stages.workers.group import ensure_ray, gc_run  # noqa: PLC0415 - CLI start-up

    check_cluster_auth(cfg.ray.address)  # before any connection (ensure_ray checks only when it connects)
    ensure_ray(cfg.ray.address, run_id=args.run_id)
    found = gc_run(args.run_id)
    print(f"run {args.run_id}: killed {len(found['actors'])} workers {found['actors']}")
    print(f"run {args.run_id}: removed {len(found['placement_groups'])} placement groups {found['placement_groups']}")
    return 0


def _add_gc_command(sub) -> None:
    g = sub.add_parser("gc", help="kill a run's Ray workers and placement groups on a cluster (after a crash)")
    g.add_argument("--run-id", required=True, help="the run whose workers to remove")
    g.add_argument("--config", default=DEFAULT_CONFIG, help="locates the cluster: ray.address")
    g.add_argument("override", nargs="*", help="key.sub=value config overrides, e.g. ray.address=auto")
    g.set_defaults(fn=cmd_gc)


def cmd_maintain(args: argparse.Namespace) -> int:
    """Compact, checkpoint and vacuum the run's Delta tables (stages/io/maintenance.py), one line per table."""
    from stages.io.maintenance import maintain_tables  # noqa: PLC0415 - CLI start-up

    reports = maintain_tables(
        _tables_root(args),
        tables=args.table or None,
        compact=not args.no_compact,
        checkpoint=not args.no_checkpoint,
        vacuum_retention_hours=None if args.no_vacuum else args.vacuum_hours,
        keep_lineage=not args.no_keep_lineage,
        enforce_retention_duration=not args.allow_short_retention,
        partition_filters=[("run_id", "=", args.run_id)] if args.run_id else None,
        dry_run=args.dry_run,
    )
    for report in reports:
        print(("(dry run) " if args.dry_run else "") + report.line())
    return 0


def _add_maintain_command(sub) -> None:
    m = sub.add_parser(
        "maintain",
        help="compact small files, write Delta checkpoints and vacuum a run's tables (docs/lake.md Maintenance)",
        description="Run it while no run writes the tables. VACUUM keeps the files of every version the lineage "
        "records (replay, rescore, resume read them) unless --no-keep-lineage.",
    )
    m.add_argument("--config", default=DEFAULT_CONFIG, help="locates the tables: <storage.root>/tables")
    m.add_argument("--table", action="append", default=[], help="only this table (repeatable; default: all)")
    m.add_argument("--run-id", default=None, help="only compact this run's partitions")
    m.add_argument("--vacuum-hours", type=int, default=168, help="VACUUM retention in hours (default 168 = 7 days)")
    m.add_argument("--no-compact", action="store_true")
    m.add_argument("--no-checkpoint", action="store_true")
    m.add_argument("--no-vacuum", action="store_true")
    m.add_argument(
        "--no-keep-lineage",
        action="store_true",
        help="also vacuum files of versions the lineage records: time travel, replay and rescore to them then fail",
    )
    m.add_argument("--allow-short-retention", action="store_true", help="allow --vacuum-hours under 168")
    m.add_argument("--dry-run", action="store_true", help="report files and what VACUUM would delete; change nothing")
    _add_table_overrides(m)
    m.set_defaults(fn=cmd_maintain)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlake", description="RL post-training of LLMs as a data pipeline.")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_run_commands(sub)
    _add_rescore_command(sub)
    _add_inspect_commands(sub)
    _add_gc_command(sub)
    _add_maintain_command(sub)
    return p


def _add_run_commands(sub) -> None:
    """train, ui, replay, export, config: commands that run or write something of a run."""
    t = sub.add_parser("train", help="run the RL iterations through Dagster in-process")
    t.add_argument("--config", default=DEFAULT_CONFIG)
    t.add_argument("--run-id", default=None, help="rlake run id (default: experiment_name-timestamp)")
    t.add_argument("--steps", type=int, default=None, help="override trainer.total_training_steps for this call")
    t.add_argument("--verbose", action="store_true", help="also print Ray/Dagster/MLflow logs and warnings to stderr")
    t.add_argument("override", nargs="*", help="key.sub=value config overrides")
    t.set_defaults(fn=cmd_train)
    u = sub.add_parser("ui", help="start Dagster's webserver and daemon on 127.0.0.1 for a run's Dagster home")
    u.add_argument("--config", default=DEFAULT_CONFIG, help="the run's config: the launchpad's default too")
    u.add_argument("--run-dir", default=None, help="the run's trainer.output_dir (same as trainer.output_dir=DIR)")
    u.add_argument("--port", type=int, default=3000)
    u.add_argument("override", nargs="*", help="key.sub=value config overrides, as given to rlake train")
    u.set_defaults(fn=cmd_ui)
    r = sub.add_parser(
        "replay",
        help="re-run a stored iteration's policy update from its tables and compare to the logged metrics",
        description="Re-runs iteration N's policy update from the advantages version its lineage recorded, "
        "starting from the stored policy_vN (kept by trainer.save_freq), into a scratch "
        "directory; compares the update metrics (actor/*) to iteration_metrics and the weights "
        "to policy_v(N+1). Exits 1 when a value differs by more than --rtol (relative, plus "
        "1e-7 absolute). Measured on CPU with the same worker count: bitwise equal.",
    )
    r.add_argument("--run-id", required=True)
    r.add_argument("--iteration", type=int, required=True)
    r.add_argument("--config", default=DEFAULT_CONFIG, help="the run's config (same overrides)")
    r.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    r.add_argument(
        "--scratch", default=None, help="where the replayed checkpoint goes (default output_dir/replay/RUN/iteration_N)"
    )
    r.add_argument("override", nargs="*", help="key.sub=value config overrides the run was trained with")
    r.set_defaults(fn=cmd_replay)
    _add_export_config_commands(sub)


def _add_export_config_commands(sub) -> None:
    """export, config: write a model directory or the resolved config."""
    ex = sub.add_parser("export", help="write a plain HF model directory from a policy checkpoint")
    ex.add_argument("--checkpoint", default=None, help="a policy_v<N> checkpoint directory")
    ex.add_argument(
        "--run-id", default=None, help="with --version: <storage.root>/checkpoints/<run-id>/policy_v<N> (fetched)"
    )
    ex.add_argument("--version", type=int, default=None)
    ex.add_argument("--config", default=DEFAULT_CONFIG, help="locates storage.root (default trainer.output_dir)")
    ex.add_argument("--out", required=True, help="directory to write (must be new or empty)")
    ex.add_argument("--overwrite", action="store_true")
    ex.add_argument("override", nargs="*", help="key.sub=value config overrides, e.g. storage.root=s3://bucket/run")
    ex.set_defaults(fn=cmd_export)
    cf = sub.add_parser("config", help="print the resolved config (defaults: bases, overrides applied) and its hash")
    cf.add_argument("--config", default=DEFAULT_CONFIG)
    cf.add_argument(
        "--yaml", action="store_true", help="nested YAML (a full config file) instead of key.sub: value lines"
    )
    cf.add_argument("override", nargs="*", help="key.sub=value config overrides")
    cf.set_defaults(fn=cmd_config)


def _add_rescore_command(sub) -> None:
    """rescore: score a past iteration again with another reward."""
    rs = sub.add_parser(
        "rescore",
        help="score a past iteration again with another reward (new table versions of that partition only)",
        description="Re-materializes scored_rollouts of one iteration of a run (with --advantages, its "
        "advantages too) from the rollouts version the iteration recorded, with the run's config plus the "
        "reward overrides given (e.g. reward.score=2.0, reward.custom_reward_function.path=my_reward.py). "
        "Nothing is generated or trained again; the previous table versions stay readable, and the "
        "printed `rlake sql` command lists the rows whose reward changed.",
    )
    rs.add_argument("--run-id", required=True)
    rs.add_argument("--iteration", type=int, required=True)
    rs.add_argument("--config", default=DEFAULT_CONFIG, help="the run's config (same overrides as its training)")
    rs.add_argument("--advantages", action="store_true", help="also recompute that iteration's advantages")
    rs.add_argument("override", nargs="*", help="key.sub=value: the run's overrides, then the new reward's")
    rs.set_defaults(fn=cmd_rescore)


def _add_table_overrides(parser: argparse.ArgumentParser) -> None:
    """--tables and the config overrides of a command that reads a run's tables (sql, lineage, plot)."""
    parser.add_argument("--tables", default=None, help="tables directory or URI, e.g. s3://bucket/run/tables")
    parser.add_argument(
        "override",
        nargs="*",
        help="key.sub=value config overrides, right after the positional argument: e.g. storage.root=s3://bucket/run",
    )


def _add_inspect_commands(sub) -> None:
    """sql, lineage, compare, plot: commands that read a run's tables and MLflow store."""
    q = sub.add_parser("sql", help="SQL (DuckDB) over every Delta table: prompts, rollouts, scored_rollouts, ...")
    q.add_argument("query")
    q.add_argument("--config", default=DEFAULT_CONFIG, help="locates the tables: <storage.root>/tables")
    q.add_argument(
        "--version",
        action="append",
        default=[],
        help="time travel: TABLE=N, or ALIAS:TABLE=N to add view ALIAS of TABLE at version N (repeatable)",
    )
    q.add_argument("--limit", type=int, default=50)
    _add_table_overrides(q)
    q.set_defaults(fn=cmd_sql)
    li = sub.add_parser("lineage", help="commit lineage of a table (run, iteration, policy, config, upstream versions)")
    li.add_argument("table")
    li.add_argument("--iteration", type=int, default=None)
    li.add_argument("--run-id", default=None)
    li.add_argument("--config", default=DEFAULT_CONFIG, help="locates the tables: <storage.root>/tables")
    _add_table_overrides(li)
    li.set_defaults(fn=cmd_lineage)
    cp = sub.add_parser("compare", help="two runs side by side from MLflow: params that differ, final/best metrics")
    cp.add_argument("run_a", help="rlake run id (MLflow tag rlake.run_id)")
    cp.add_argument("run_b")
    cp.add_argument("--config", default=DEFAULT_CONFIG, help="locates the MLflow store")
    cp.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (overrides --config)")
    cp.add_argument("--experiment", default=None, help="only look in this MLflow experiment (trainer.project_name)")
    cp.add_argument("--metrics", default="", help="comma-separated metric name prefixes to show (default: all)")
    cp.set_defaults(fn=cmd_compare)
    pl = sub.add_parser(
        "plot",
        help="PNG of a run's curves from iteration_metrics: reward, response length, KL, entropy, validation rewards",
    )
    pl.add_argument("run", help="rlake run id")
    pl.add_argument("--out", default=None, help="PNG path (default <output_dir>/plots/<run>.png)")
    pl.add_argument("--config", default=DEFAULT_CONFIG, help="locates the tables: <storage.root>/tables")
    _add_table_overrides(pl)
    pl.set_defaults(fn=cmd_plot)


def main(argv: list[str] | None = None) -> int:
    """The `rlake` command with `argv` (None: the process's own arguments, and the process ends here with the
    command's exit status: exit_now)."""
    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
    except (ValidationError, FileNotFoundError, FileExistsError, ValueError) as exc:
        if os.environ.get("RLAKE_DEBUG"):
            raise
        print(f"rlake {args.cmd}: error: {exc}", file=sys.stderr)
        code = 2
    if argv is None:
        exit_now(code)
    return code


def exit_now(code: int) -> NoReturn:
    """End the process with `code` as the interpreter does, less its teardown: the other threads joined (and their
    exit hooks run), every atexit handler run (Ray's shutdown, logging's flush and close, MLflow's, weakref
    finalizers), stdout and stderr flushed, then os._exit. What is skipped is freeing the heap object by object:
    after a training run ~2.3 s of final garbage collection over torch, transformers and Dagster objects
    (docs/testing.md), which is also where triton's bindings print their leak warnings. Every file rlake writes is
    closed by then (`with` blocks; Delta and MLflow commits are done)."""
    threading._shutdown()  # what Py_FinalizeEx does first: non-daemon threads joined, thread atexit hooks run
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more can reach the reader
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
