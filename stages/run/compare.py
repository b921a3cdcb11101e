"""Side-by-side comparison of two rlake runs from their MLflow records (`rlake compare RUN_A RUN_B`).

A rlake run is found by its MLflow tag `rlake.run_id` (one MLflow run per rlake run; see
assets/resources.TrackerResource). The comparison lists the flattened config params whose values
differ and, per metric, the final value (at the last step) and the best value over steps (max for
rewards, scores and accuracies, min for losses, none otherwise) of both runs. MLflow stores metric
names with '@' written as '_at_'; they are printed back with '@' (stages.metric_names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlflow.tracking import MlflowClient

from stages.metric_names import metric_name_from_mlflow

HIGHER_IS_BETTER = ("reward", "score", "acc")
LOWER_IS_BETTER = ("loss",)


@dataclass(frozen=True)
class RunRecord:
    rlake_run_id: str
    mlflow_run_id: str
    experiment: str
    status: str
    params: dict[str, str]
    history: dict[str, list[tuple[int, float]]]  # metric -> [(step, value)] sorted by step


@dataclass(frozen=True)
class Comparison:
    a: RunRecord
    b: RunRecord
    param_diffs: list[tuple[str, str | None, str | None]]
    metric_rows: list[tuple[str, float | None, float | None, float | None, float | None, int | None, int | None]]
    """(metric, final_a, final_b, best_a, best_b, last_step_a, last_step_b)"""
    notes: list[str] = field(default_factory=list)


def best_direction(metric: str) -> str | None:
    """'max' / 'min' / None by the metric's path segments (timings and fractions have no best)."""
    parts = metric.lower().split("/")
    if parts[0] == "timing_s" or parts[-1].endswith("_frac"):
        return None
    if any(k in p for p in parts for k in LOWER_IS_BETTER):
        return "min"
    if any(p.rstrip("s") in HIGHER_IS_BETTER for p in parts):
        return "max"
    return None


def find_run(client, rlake_run_id: str, experiment: str | None = None) -> RunRecord:
    """The MLflow record of rlake run `rlake_run_id` (tag rlake.run_id), optionally within one experiment."""
    exps = client.search_experiments()
    if experiment is not None:
        exps = [e for e in exps if e.name == experiment]
        if not exps:
            raise ValueError(
                f"MLflow experiment '{experiment}' does not exist at {client.tracking_uri}; "
                "pass the trainer.project_name the runs were logged under, or drop --experiment."
            )
    ids = [e.experiment_id for e in exps]
    names = {e.experiment_id: e.name for e in exps}
    found = client.search_runs(ids, filter_string=f"tags.`rlake.run_id` = '{rlake_run_id}'", max_results=2)
    if not found:
        known = sorted({r.data.tags.get("rlake.run_id", "?") for r in client.search_runs(ids, max_results=200)})
        raise ValueError(
            f"no MLflow run tagged rlake.run_id='{rlake_run_id}' at {client.tracking_uri}; "
            f"known rlake run ids: {known}. Pass a run id `rlake train` printed, and the "
            "--config (or --tracking-uri) of the output_dir it wrote to."
        )
    run = found[0]
    history = {}
    for key in run.data.metrics:
        points = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        history[metric_name_from_mlflow(key)] = points
    return RunRecord(
        rlake_run_id,
        run.info.run_id,
        names.get(run.info.experiment_id, run.info.experiment_id),
        run.info.status,
        dict(run.data.params),
        history,
    )


def _final_best(points: list[tuple[int, float]] | None, direction: str | None):
    if not points:
        return None, None, None
    values = [v for _, v in points]
    best = max(values) if direction == "max" else min(values) if direction == "min" else None
    return points[-1][1], best, points[-1][0]


def compare_runs(
    tracking_uri: str, run_a: str, run_b: str, *, experiment: str | None = None, metric_prefixes: tuple[str, ...] = ()
) -> Comparison:
    """Read both runs from the MLflow store at tracking_uri and line them up."""
    client = MlflowClient(tracking_uri=tracking_uri)
    a, b = find_run(client, run_a, experiment), find_run(client, run_b, experiment)
    skip = {"trainer.run_id"}
    diffs = [
        (k, a.params.get(k), b.params.get(k))
        for k in sorted(set(a.params) | set(b.params))
        if k not in skip and a.params.get(k) != b.params.get(k)
    ]
    rows = []
    for key in sorted(set(a.history) | set(b.history)):
        if metric_prefixes and not key.startswith(metric_prefixes):
            continue
        d = best_direction(key)
        fa, ba, sa = _final_best(a.history.get(key), d)
        fb, bb, sb = _final_best(b.history.get(key), d)
        rows.append((key, fa, fb, ba, bb, sa, sb))
    notes = []
    if a.experiment != b.experiment:
        notes.append(
            f"the runs are in different MLflow experiments ('{a.experiment}', '{b.experiment}'): the MLflow "
            "UI shows them side by side only when trainer.project_name is the same"
        )
    return Comparison(a, b, diffs, rows, notes)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"


def format_comparison(c: Comparison) -> str:
    """Plain-text tables: runs, differing params, metrics (final and best of each run)."""
    A, B = c.a.rlake_run_id, c.b.rlake_run_id
    lines = [
        f"A = {A}  (MLflow run {c.a.mlflow_run_id}, experiment '{c.a.experiment}', {c.a.status})",
        f"B = {B}  (MLflow run {c.b.mlflow_run_id}, experiment '{c.b.experiment}', {c.b.status})",
        "",
    ]
    lines += [f"params that differ ({len(c.param_diffs)}):"]
    if c.param_diffs:
        w = max(len(k) for k, _, _ in c.param_diffs)
        wa = max(len(str(va)) for _, va, _ in c.param_diffs)
        lines += [f"  {'param':<{w}}  {'A':<{wa}}  B"]
        lines += [f"  {k:<{w}}  {va!s:<{wa}}  {vb}" for k, va, vb in c.param_diffs]
    else:
        lines += ["  (none: same config)"]
    lines += [
        "",
        (
            f"metrics ({len(c.metric_rows)}): final = value at the last logged step; best = max for "
            "reward/score/acc, min for loss"
        ),
    ]
    if c.metric_rows:
        w = max(len(r[0]) for r in c.metric_rows)
        lines += [f"  {'metric':<{w}}  {'final A':>10}  {'final B':>10}  {'best A':>10}  {'best B':>10}  steps A/B"]
        for key, fa, fb, ba, bb, sa, sb in c.metric_rows:
            lines += [
                (
                    f"  {key:<{w}}  {_fmt(fa):>10}  {_fmt(fb):>10}  {_fmt(ba):>10}  {_fmt(bb):>10}  "
                    f"{'-' if sa is None else sa}/{'-' if sb is None else sb}"
                )
            ]
    lines += [f"note: {n}" for n in c.notes]
    return "\n".join(lines) + "\n"
