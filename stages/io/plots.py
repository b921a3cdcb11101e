"""Curves of one run from the `iteration_metrics` Delta table, as matplotlib figures.

Used by `rlake plot RUN` (training + validation panels), by the iteration_metrics asset's `run_curves`
metadata (the same figure of its run, shown by the Dagster UI), by the MLflow run's final
`validation_curve.png` (stages.io.tracking) and by scripts/plot_validation.py. Figures are built with
`matplotlib.figure.Figure` (no pyplot global state, no GUI backend), so plotting inside a Dagster
asset or a test does not depend on the display. matplotlib is a dependency of mlflow.

x axes: the rows of iteration i carry policy_version i+1 (the update's result, MLflow step i+1);
iteration -1 holds the validation of policy v0. Training-rollout panels plot against the iteration
(= the policy version that generated the rollouts), validation against the validated policy version.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import pyarrow as pa
from matplotlib.figure import Figure
from pyarrow.dataset import FileSystemDataset

from stages.io import uris
from stages.io.store import open_table, table_exists

METRICS_TABLE = "iteration_metrics"
VAL_REWARD = r"^val-(core|aux)/(.+)/reward/mean@(\d+)$"
TRAIN_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("training reward", ("critic/score/mean",)),
    ("response length (tokens)", ("response_length/mean",)),
    ("KL", ("actor/ppo_kl", "actor/kl_loss")),
    ("entropy", ("actor/entropy",)),
)
METRIC_COLUMNS = ["iteration", "policy_version", "metric", "value"]

_RUN_ROWS: OrderedDict[tuple, tuple[pa.Schema, list[tuple[frozenset[str], pa.Table]]]] = OrderedDict()
"""This process's METRIC_COLUMNS of a run's iteration_metrics data files (by table and run): the table's schema and
groups of (data files, their rows). A Delta data file never changes, so load_run_metrics reads only the files it
has not read (one per iteration), not every past iteration's again at every iteration (the asset's run_curves)."""
_RUN_ROWS_LOCK = threading.Lock()
RUNS_KEPT = 8
"""(table, run) pairs _RUN_ROWS keeps, the most recently read."""


def load_run_metrics(
    tables_root: str | Path, run_id: str, *, storage_options: Mapping[str, str] | None = None
) -> pd.DataFrame:
    """iteration_metrics rows of one run (iteration, policy_version, metric, value), newest table version.
    `tables_root`: a storage URI (local or s3://, opened with `storage_options` or those it carries).

    Raises FileNotFoundError without the table, LookupError (naming the runs it holds) without rows."""
    uri = uris.join(tables_root, METRICS_TABLE)
    if not table_exists(uri, storage_options=storage_options):
        raise FileNotFoundError(
            f"no {METRICS_TABLE} Delta table at '{uri}': the tables of a run are under <storage.root>/tables "
            "(default <trainer.output_dir>/tables)"
        )
    dt = open_table(uri, storage_options=storage_options)
    key = (uris.target(uri), json.dumps(uris.options_of(uri, storage_options) or {}, sort_keys=True), run_id)
    df = _run_rows(dt, key, run_id).to_pandas()
    if df.empty:
        known = sorted(dt.to_pandas(columns=["run_id"])["run_id"].unique())
        raise LookupError(f"run '{run_id}' has no rows in {uri}; runs there: {', '.join(known) or 'none'}")
    return df.sort_values(["iteration", "metric"]).reset_index(drop=True)  # one row per (iteration, metric)


def _run_rows(dt, key: tuple, run_id: str) -> pa.Table:
    """METRIC_COLUMNS of run `run_id`'s data files at `dt`'s version, in no particular order: the groups of files
    read before that are all still in the table, plus the files not read yet (read together, as to_pandas
    would). A group with a file an overwrite removed is dropped and its files still there are read again."""
    ds = dt.to_pyarrow_dataset(file_pruning_predicate=[("run_id", "=", run_id)])
    fragments = {f.path: f for f in ds.get_fragments()}
    with _RUN_ROWS_LOCK:
        schema, groups = _RUN_ROWS.pop(key, (ds.schema, []))
    kept = [(paths, rows) for paths, rows in groups if schema == ds.schema and paths <= fragments.keys()]
    covered = frozenset().union(*(paths for paths, _ in kept))
    new = [f for path, f in fragments.items() if path not in covered]
    if new or not kept:
        rows = FileSystemDataset(new, ds.schema, ds.format, ds.filesystem).to_table(columns=METRIC_COLUMNS)
        kept.append((frozenset(f.path for f in new), rows))
    with _RUN_ROWS_LOCK:
        _RUN_ROWS[key] = (ds.schema, kept)
        while len(_RUN_ROWS) > RUNS_KEPT:
            _RUN_ROWS.popitem(last=False)
    return pa.concat_tables([rows for _, rows in kept])


def validation_rewards(df: pd.DataFrame) -> pd.DataFrame:
    """policy_version x val reward metric: the greedy pass's val-core/<ds>/reward/mean@1 and the sampled pass's
    mean@n (val-core/ since verl's split, val-aux/ in runs logged before it)."""
    val = df[df["metric"].str.match(VAL_REWARD)]
    return val.pivot_table(index="policy_version", columns="metric", values="value").sort_index()


def _val_label(metric: str) -> str:
    _, ds, n = re.match(VAL_REWARD, metric).groups()
    return f"greedy pass@1 ({ds})" if n == "1" else f"sampled mean@{n} ({ds})"


def _plot_validation(ax, df: pd.DataFrame, *, annotate: bool) -> bool:
    """Validation reward curves on ax; False when the run has no validation rows."""
    val = validation_rewards(df)
    for metric in sorted(val.columns, key=lambda m: (not m.endswith("/mean@1"), m)):  # greedy first
        s = val[metric].dropna()
        ax.plot(s.index, s.values, marker="o", label=_val_label(metric))
        if annotate:
            for x, y in zip(s.index, s.values):
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("policy version (RL iterations done)")
    ax.set_ylabel("validation reward")
    ax.grid(alpha=0.3)
    if not val.empty:
        ax.legend(fontsize=7, loc="best")
    return not val.empty


def validation_figure(df: pd.DataFrame, title: str):
    """Validation reward per policy version, with the training reward of each iteration dashed."""
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    _plot_validation(ax, df, annotate=True)
    train = df[df["metric"] == "critic/score/mean"].sort_values("iteration")
    if not train.empty:  # iteration i's rollouts come from policy version i
        ax.plot(
            train["iteration"],
            train["value"],
            color="gray",
            alpha=0.6,
            linestyle="--",
            label="training reward (critic/score/mean)",
        )
        ax.legend(fontsize=7, loc="best")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def run_figure(df: pd.DataFrame, title: str):
    """One figure, a panel each: training reward, response length, KL, entropy, validation rewards."""
    fig = Figure(figsize=(12, 7))
    axes = fig.subplots(2, 3).ravel()
    for ax, (name, metrics) in zip(axes, TRAIN_PANELS):
        drawn = False
        for metric in metrics:
            s = df[df["metric"] == metric].sort_values("iteration")
            if not s.empty:
                ax.plot(s["iteration"], s["value"], marker=".", label=metric)
                drawn = True
        if drawn:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(
                0.5,
                0.5,
                "not logged: " + ", ".join(metrics),
                ha="center",
                va="center",
                fontsize=8,
                transform=ax.transAxes,
            )
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    if not _plot_validation(axes[4], df, annotate=False):
        axes[4].text(0.5, 0.5, "no validation rows", ha="center", va="center", fontsize=8, transform=axes[4].transAxes)
    axes[4].set_title("validation reward", fontsize=9)
    axes[5].set_axis_off()
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def save_png(fig, path: str | Path, *, dpi: int = 110) -> Path:
    """Write fig as PNG to path (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    return path


def run_curves_markdown(
    tables_root: str | Path, run_id: str, *, storage_options: Mapping[str, str] | None = None, dpi: int = 55
) -> str:
    """Markdown holding a PNG (base64 data URI) of one run's run_figure: the curves of `run_id` alone (the Dagster
    UI's Plots tab draws each metric across every run's partitions on one axis; this figure is per run). About
    40 KB at the default dpi."""
    df = load_run_metrics(tables_root, run_id, storage_options=storage_options)
    buf = io.BytesIO()
    run_figure(df, f"run {run_id}").savefig(buf, dpi=dpi, format="png")
    return f"![curves of run {run_id}](data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()})"
