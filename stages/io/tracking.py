"""What an rlake run records in MLflow beyond its metrics: status, Delta lineage, samples, code, curve.

- Status: a run is RUNNING while it logs (a resumed or re-materialized run reopens), FINISHED when
  the last iteration's metrics are in, FAILED / KILLED when `rlake train` ends on an error / Ctrl-C, set-up
  included (warm start, Ray, Dagster: `rlake train` creates the MLflow run right after preflight), with the
  error in tag rlake.error.
- Lineage: each iteration logs, as MLflow dataset inputs, the Delta table versions it read and wrote:
  source type `delta_table` with the table URI and version (what `mlflow.data.get_source` reads back
  as a DeltaDatasetSource, no Spark needed), context tag = the table. The versions come from the Delta
  commit lineage: starting at the iteration_metrics commit, following each commit's `upstream`.
- Samples: validation rollouts (prompt, response, ground truth, reward, policy version) as an MLflow
  table `samples/val_step_<N>.json` (N = policy version = metric step).
- Code: the git commit of the rlake checkout as `mlflow.source.git.commit` and `rlake.git_commit`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.data.delta_dataset_source import DeltaDatasetSource
from mlflow.entities import Dataset, DatasetInput, InputTag

from stages.dag import TABLES
from stages.io import uris
from stages.io.plots import load_run_metrics, validation_figure
from stages.io.store import History, commit_at, git_commit, of_partition, table_exists

END_STATUSES = ("FINISHED", "FAILED", "KILLED")
ERROR_TAG = "rlake.error"
"""Tag of a FAILED / KILLED run: `<exception type>: <message>` of what ended it (set-up included)."""
MAX_ERROR_CHARS = 5000
"""rlake.error is cut to this (MLflow stores tag values up to 8000 characters)."""
TRACKING_SERVER_SCHEMES = ("http", "https", "databricks")
"""Tracking URIs of an MLflow server: the server decides where its experiments' artifacts go."""
SAMPLE_COLUMNS = [
    "prompt_text",
    "response_text",
    "ground_truth",
    "reward",
    "policy_version",
    "sampling",
    "prompt_id",
    "sample_index",
    "data_source",
    "response_length",
    "finish_reason",
]
"""What a reader looks at first comes first (MLflow's table view shows the leftmost columns)."""
VALIDATION_FIGURE = "validation_curve.png"


def is_tracking_server(tracking_uri: str) -> bool:
    """An MLflow tracking server (http/https, Databricks) rather than a store the client opens (sqlite, a
    database URI, a directory): a server with `--serve-artifacts` proxies artifact uploads to its
    `--artifacts-destination` (e.g. s3://bucket/mlartifacts), so clients need no artifact root or credentials."""
    return tracking_uri.split(":", 1)[0].lower() in TRACKING_SERVER_SCHEMES


def code_tags() -> dict[str, str]:
    sha = git_commit()
    return {"mlflow.source.git.commit": sha, "rlake.git_commit": sha} if sha else {}


def iteration_lineage(
    tables_root: str | Path,
    run_id: str,
    iteration: int,
    *,
    metrics_version: int | None = None,
    storage_options: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One Delta commit per table written for (run_id, iteration), in stages/dag.py's TABLES order.

    Tables reached from the iteration_metrics commit `metrics_version` (default: its newest for the
    iteration) through the commits' `upstream` versions get the version that was read; a table with
    commits for the iteration but not reached gets its newest. Each entry: table, uri, version, and
    the commit's lineage (stage, policy_version, upstream, ...). A reached commit is read from its own commit file
    (store.commit_at: once per process, no table opened: on S3 no LIST); only the tables not reached are opened,
    their history read only down to the commits wanted (store.History), so the cost stays flat as a run grows."""
    root = uris.with_options(tables_root, uris.options_of(tables_root, storage_options))
    where = {table: uris.join(root, table) for table in TABLES}  # a string join: s3:// stays, options carried
    opened: dict[str, History | None] = {}

    def history(table: str) -> History | None:
        if table not in opened:
            opened[table] = History(where[table]) if table_exists(where[table]) else None
        return opened[table]

    chosen: dict[str, dict[str, Any]] = {}
    if metrics_version is None and (start := history("iteration_metrics")) is not None:
        metrics_version = (start.newest(run_id, iteration) or {}).get("version")
    todo = [("iteration_metrics", metrics_version)]
    while todo:
        table, version = todo.pop()
        if table not in where or table in chosen or version is None:
            continue
        commit = commit_at(where[table], int(version))
        if of_partition(commit, run_id, iteration):  # not another iteration's commit (e.g. prompts)
            chosen[table] = commit
            todo += list((commit.get("upstream") or {}).items())
    out = []
    for table, uri in where.items():  # TABLES order
        commit = chosen.get(table)
        if commit is None and (unreached := history(table)) is not None:
            commit = unreached.newest(run_id, iteration)
        if commit is not None:
            out.append({"table": table, "uri": str(uri), **commit})
    return out


def delta_dataset_input(entry: dict[str, Any], iteration: int):
    """An MLflow DatasetInput for one lineage entry: dataset named after the table, source = URI + version."""
    version = int(entry["version"])
    # built by hand: DeltaDatasetSource.to_dict() drops a version of 0 (falsy); from_dict reads this back
    source = json.dumps({"path": entry["uri"], "delta_table_version": version})
    digest = hashlib.sha256(f"{entry['table']}\n{source}".encode()).hexdigest()[:8]
    # the UI shows the profile (not the source or the input tags): the version and path go there too
    profile = {
        "delta_version": version,
        "path": entry["uri"],
        **{k: entry.get(k) for k in ("run_id", "iteration", "stage", "policy_version", "upstream", "code_version")},
    }
    dataset = Dataset(
        name=entry["table"],
        digest=digest,
        source_type=DeltaDatasetSource._get_source_type(),
        source=source,
        profile=json.dumps(profile, default=str),
    )
    tags = [
        InputTag("mlflow.data.context", entry["table"]),
        InputTag("rlake.iteration", str(iteration)),
        InputTag("rlake.delta_version", str(version)),
    ]
    return DatasetInput(dataset, tags=tags)


def log_lineage(
    client,
    mlflow_run_id: str,
    tables_root: str | Path,
    run_id: str,
    iteration: int,
    *,
    metrics_version: int | None = None,
    storage_options: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Log the iteration's table versions as dataset inputs of the MLflow run; returns the lineage entries.
    Idempotent: MLflow keeps one input per (dataset name, digest) and run."""
    entries = iteration_lineage(
        tables_root, run_id, iteration, metrics_version=metrics_version, storage_options=storage_options
    )
    if entries:
        client.log_inputs(mlflow_run_id, datasets=[delta_dataset_input(e, iteration) for e in entries])
    return entries


def validation_samples(scored: dict[str, pd.DataFrame], *, policy_version: int, max_rows: int = 32) -> pd.DataFrame:
    """The first max_rows rows of each validation mode (stages.evaluate.validation_rollouts' output)."""
    parts = [df.head(max_rows).assign(sampling=mode, policy_version=policy_version) for mode, df in scored.items()]
    out = pd.concat(parts, ignore_index=True)
    return out[[c for c in SAMPLE_COLUMNS if c in out.columns]]


def log_validation_samples(
    client,
    mlflow_run_id: str,
    scored: dict[str, pd.DataFrame],
    *,
    policy_version: int,
    metrics_version: int | None = None,
) -> str:
    """MLflow table samples/val_step_<policy_version>.json; a re-materialization appends (MLflow's log_table),
    its rows told apart by iteration_metrics_version. Returns the artifact path."""
    artifact = f"samples/val_step_{policy_version}.json"
    samples = validation_samples(scored, policy_version=policy_version).assign(
        iteration_metrics_version=metrics_version
    )
    client.log_table(mlflow_run_id, data=samples, artifact_file=artifact)
    return artifact


def log_validation_figure(
    client, mlflow_run_id: str, tables_root: str | Path, run_id: str, *, storage_options: dict[str, str] | None = None
) -> str:
    """validation_curve.png (stages.io.plots.validation_figure) of the run's iteration_metrics rows."""
    metrics = load_run_metrics(tables_root, run_id, storage_options=storage_options)
    fig = validation_figure(metrics, f"validation curve, run {run_id}")
    client.log_figure(mlflow_run_id, fig, VALIDATION_FIGURE)
    return VALIDATION_FIGURE


def set_status(client, mlflow_run_id: str, status: str) -> None:
    """RUNNING (reopen; the previous end time stays until the next end), or one of END_STATUSES."""
    if status == "RUNNING":
        client.update_run(mlflow_run_id, status="RUNNING")
    elif status in END_STATUSES:
        client.set_terminated(mlflow_run_id, status=status)
    else:
        raise ValueError(f"unknown MLflow run status '{status}'. Valid: {['RUNNING', *END_STATUSES]}")
