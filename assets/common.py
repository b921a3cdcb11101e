"""Shared pieces of the assets: partitions, groups, lineage metadata, recorded upstream reads.

Partitions keep runs apart: set-up assets are partitioned by run (`runs`, the run id), iteration assets by
run x iteration (`run_iterations`, key "<iteration>|<run id>" in Dagster's string form), so two runs'
iteration 3 are two partitions, and the UI's partition view shows one row of iterations per run."""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import dagster as dg
import pandas as pd

from configs.schema import RunConfig
from stages.dag import SETUP, STAGES, TABLES
from stages.io import store
from stages.io.checkpoints import checkpoint_row
from stages.io.stage_exec import Partition, partition_rows
from stages.io.tables import PROMPTS_ITERATION

runs = dg.DynamicPartitionsDefinition(name="run")
"""One partition per rlake run id (set-up assets; the `run` dimension of run_iterations)."""
iterations = dg.DynamicPartitionsDefinition(name="iteration")
"""Iteration numbers "0", "1", ... (the `iteration` dimension of run_iterations)."""
run_iterations = dg.MultiPartitionsDefinition({"run": runs, "iteration": iterations})
"""The iteration assets' partitions: (run id, iteration)."""


def partition_key(run_id: str, iteration: int) -> dg.MultiPartitionKey:
    """The run_iterations key of iteration `iteration` of run `run_id` (str(): "<iteration>|<run id>")."""
    return dg.MultiPartitionKey({"run": run_id, "iteration": str(iteration)})


def add_partitions(instance: dg.DagsterInstance, run_id: str, iteration: int | None = None) -> None:
    """Register run `run_id` (and its iteration `iteration`) as partitions, so a run of that partition can launch."""
    instance.add_dynamic_partitions(runs.name, [run_id])
    if iteration is not None:
        instance.add_dynamic_partitions(iterations.name, [str(iteration)])


def iteration_of(context) -> int:
    """The iteration of an iteration asset's partition (run_iterations)."""
    return int(context.partition_key.keys_by_dimension["iteration"])


def asset_deps(name: str) -> list[dg.AssetDep]:
    """Stage `name`'s Dagster deps (stages/dag.py upstream): an iteration asset depends on a set-up asset
    (partitioned by run) through the run dimension of its own (run, iteration) partition."""
    setup = {s.name for s in SETUP}
    with warnings.catch_warnings():  # beta in Dagster 1.13; the mapping rlake relies on is the documented one
        warnings.simplefilter("ignore", dg.BetaWarning)
        by_run = dg.MultiToSingleDimensionPartitionMapping(partition_dimension_name="run")
    iteration_stage = name not in setup
    return [
        dg.AssetDep(up, partition_mapping=by_run) if iteration_stage and up in setup else dg.AssetDep(up)
        for up in STAGES[name].upstream
    ]


def check_spec(name: str, *, asset: str, **kwargs) -> dg.AssetCheckSpec:
    """An asset check of an iteration asset, partitioned like it: each (run, iteration) has its own
    evaluation, shown per partition in the UI (a Dagster preview feature in 1.13: its warning is silenced here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return dg.AssetCheckSpec(name, asset=asset, partitions_def=run_iterations, **kwargs)


def data_version(table: str, version: int) -> dg.DataVersion:
    """The Dagster data version of a stage that wrote Delta version `version` of `table`: a re-materialization
    writes a new version, so the downstream assets of that partition show as stale in the UI."""
    return dg.DataVersion(f"{table}@{int(version)}")


def checkpoint_version(kind: str, version: int, context) -> dg.DataVersion:
    """The data version of a checkpoint asset: the checkpoint version and the Dagster run that wrote it (a
    re-materialization rewrites policy_v<N> / critic_v<N> in place, so the writer is what changes)."""
    return dg.DataVersion(f"{kind}_v{version}@run:{context.run_id[:8]}")


def outside_dag(cfg: RunConfig, name: str, checks: tuple[str, ...] = ()) -> dg.MaterializeResult | None:
    """None when a run with `cfg` has stage `name` (stages/dag.py `when`); else what the asset returns instead
    of computing: the iteration job holds every stage, and a stage the launched config does not use (the
    critic's without GAE, ref_logprobs without KL, judgements without a judge) writes nothing."""
    stage = STAGES[name]
    if stage.when(cfg):
        return None
    why = f"not in this run's DAG: {stage.when.__name__} is false for its config ({(stage.when.__doc__ or '').strip()})"
    return dg.MaterializeResult(
        metadata={"in_dag": False, "why": why},
        data_version=dg.DataVersion("not-in-dag"),
        check_results=[dg.AssetCheckResult(check_name=c, passed=True, metadata={"skipped": why}) for c in checks],
    )


def lineage(
    cfg: RunConfig, *, stage: str, policy_version: int | None, upstream: dict[str, int | None], duration_s: float
) -> dict:
    """Commit metadata every table write carries (run id, iteration and code version are added by the store)."""
    sources = {t: getattr(v, "source", "newest") for t, v in upstream.items()}
    return {
        "stage": stage,
        "policy_version": str(policy_version),
        "config_hash": cfg.config_hash(),
        "upstream": {t: None if v is None else int(v) for t, v in upstream.items()},
        "upstream_version_source": sources,
        "duration_s": f"{duration_s:.3f}",
    }


class UpstreamVersion(int):
    """A Delta table version plus where it came from: "dagster" (the upstream asset's latest
    materialization of this partition recorded it) or "newest" (no such record: the table's newest version)."""

    source: str

    def __new__(cls, version: int, source: str) -> UpstreamVersion:
        obj = super().__new__(cls, version)
        obj.source = source
        return obj


def recorded_version(
    instance: dg.DagsterInstance, uri: str, table: str, run_id: str, iteration: int, *, lookback: int = 20
) -> int | None:
    """The Delta version of `table` that the upstream asset's latest materialization of this iteration's
    partition recorded ("delta_version" metadata), checked against the commit's own lineage (same run,
    same iteration), so materializations of another rlake run or another output_dir are skipped.
    The asset that writes a table has the table's name (stages/dag.py). Reads the table's history only down to
    the versions it checks (store.first_commit_of): the cost stays flat as the history grows."""
    if table not in TABLES:
        return None
    partitions = [run_id if iteration == PROMPTS_ITERATION else str(partition_key(run_id, iteration))]
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(table), asset_partitions=partitions), limit=lookback
    ).records
    metadata = [rec.asset_materialization.metadata if rec.asset_materialization else {} for rec in records]
    versions = [int(m["delta_version"].value) for m in metadata if m.get("delta_version") is not None]
    return store.first_commit_of(uri, versions, run_id, iteration)  # newest record first


def read_recorded(
    context, rollout_store, table: str, run_id: str, iteration: int
) -> tuple[pd.DataFrame, UpstreamVersion]:
    """Read an upstream partition at the version its asset's latest materialization recorded, falling back
    to the table's newest version (source "newest") for tables written outside Dagster."""
    uri = rollout_store.uri(table)
    version = recorded_version(context.instance, uri, table, run_id, iteration)
    if version is None:
        df, newest = rollout_store.read(table, run_id, iteration)
        context.log.warning(
            f"no Dagster materialization of '{table}' records a version "
            f"of '{table}' for run {run_id} iteration {iteration}: reading its newest version {newest}"
        )
        return df, UpstreamVersion(newest, "newest")
    df, _ = rollout_store.read(table, run_id, iteration, version=version)
    return df, UpstreamVersion(version, "dagster")


def upstream_version(context, rollout_store, table: str, run_id: str, iteration: int) -> UpstreamVersion:
    """The version read_recorded would read, without reading any row (for a stage that streams the partition or
    whose workers read it): the one the upstream asset's latest materialization recorded, else the table's newest
    (source "newest", with read_recorded's warning). A missing table or partition raises as read_recorded does
    (the partition's rows counted from the Delta log's file stats)."""
    uri = rollout_store.uri(table)
    version = recorded_version(context.instance, uri, table, run_id, iteration)
    if version is not None:
        return UpstreamVersion(version, "dagster")
    if not store.table_exists(uri):
        raise FileNotFoundError(f"no Delta table at '{uri}': materialize its asset first")
    newest = store.table_version(uri)
    if not partition_rows(uri, run_id, iteration, version=newest):
        raise store.missing_partition_error(uri, newest, run_id, iteration)
    context.log.warning(
        f"no Dagster materialization of '{table}' records a version "
        f"of '{table}' for run {run_id} iteration {iteration}: reading its newest version {newest}"
    )
    return UpstreamVersion(newest, "newest")


def upstream_partition(context, rollout_store, table: str, run_id: str, iteration: int) -> Partition:
    """The partition read_recorded would read, as a handle a stage streams (its version: upstream_version's)."""
    version = upstream_version(context, rollout_store, table, run_id, iteration)
    return Partition(rollout_store.uri(table), run_id, iteration, version)


def write_table(
    rollout_store,
    cfg: RunConfig,
    table: str,
    df: pd.DataFrame,
    iteration: int,
    *,
    policy_version: int | None,
    upstream: dict,
    duration_s: float = 0.0,
    stage: str | None = None,
) -> int:
    """Write a stage's partition of `table` with its lineage (stage: the asset, named like the table unless
    given); returns the new Delta version. Upstream entries that are None (tables the run does not use) are
    left out."""
    upstream = {k: v for k, v in upstream.items() if v is not None}
    meta = lineage(cfg, stage=stage or table, policy_version=policy_version, upstream=upstream, duration_s=duration_s)
    return rollout_store.write(table, df, run_id=cfg.run_id, iteration=iteration, lineage=meta)


def record_checkpoint(
    rollout_store, cfg: RunConfig, manifest: dict, iteration: int, *, upstream: dict, metrics: dict | None = None
) -> int:
    """The `checkpoints` table row of a commit (stages.io.checkpoints) in partition (run, iteration), with the
    writing stage's lineage (the table versions it read); rows of other checkpoints of the partition are kept
    (the policy and critic updates of one iteration each write theirs). Returns the new Delta version."""
    row = checkpoint_row(manifest, metrics)
    rows = pd.DataFrame([row])
    uri = rollout_store.uri("checkpoints")
    if store.table_exists(uri):
        try:
            old, _ = rollout_store.read("checkpoints", cfg.run_id, iteration)
            keep = ~((old["kind"] == row["kind"]) & (old["version"] == row["version"]))
            rows = pd.concat([old[keep].drop(columns=["run_id", "iteration"]), rows], ignore_index=True)
        except LookupError:
            pass  # the partition's first checkpoint
    stage = f"{row['kind']}_checkpoint" if row["version"] else f"initial_{row['kind']}"
    return write_table(
        rollout_store,
        cfg,
        "checkpoints",
        rows,
        iteration,
        policy_version=row["version"],
        upstream=upstream,
        stage=stage,
    )


def checkpoint_metrics(rollout_store, run_id: str, iteration: int, kind: str, version: int) -> tuple[dict, int]:
    """(the update metrics recorded with `kind` version `version` in the `checkpoints` table, table version read):
    what the update returned through Ray, written by the asset that committed the checkpoint."""
    rows, table_version = rollout_store.read("checkpoints", run_id, iteration)
    row = rows[(rows["kind"] == kind) & (rows["version"] == version)]
    if not len(row):
        raise LookupError(
            f"the checkpoints table has no row for {kind} version {version} of run {run_id} (iteration {iteration}): "
            f"materialize {kind}_checkpoint of iteration {iteration} first"
        )
    return json.loads(row.iloc[-1]["metrics"] or "{}"), table_version


def train_prompt_count(rollout_store, run_id: str) -> int:
    """Training prompts of run `run_id` (the epoch length of the data cursor in trainer_state.json)."""
    rows, _ = rollout_store.read("prompts", run_id, PROMPTS_ITERATION, columns=["split"])
    return int((rows["split"] == "train").sum())


@contextmanager
def timed():
    box = {"s": 0.0}
    t0 = time.perf_counter()
    try:
        yield box
    finally:
        box["s"] = time.perf_counter() - t0


class Background:
    """Calls that run on threads of their own while the caller goes on: one thread per `lane`, whose calls run one
    after another in the order submitted, as they would inline (once one raises, the lane's later calls do not run
    and raise its exception), each in the caller's store.pinned() scope (store.in_this_scope).

    Leaving the `with` block waits for every call, whether the block raised or not; then the first call that raised,
    in the order submitted, raises its exception again (the block's own, if any, is its __context__), else the
    block's exception goes on. A call submitted where it used to run inline was submitted before anything the block
    does after it, so the step still fails with what failed first in the order it ran before.

    threads=False: each call runs when it is submitted, on the caller's thread, as inline code (where the calls wait
    on nothing, e.g. local files and sqlite, a thread would only contend for the GIL with the caller)."""

    def __init__(self, *, threads: bool = True) -> None:
        self._threads = threads
        self._lanes: dict[str, ThreadPoolExecutor] = {}
        self._calls: list[Future] = []
        self._last: dict[str, Future] = {}

    def submit(self, lane: str, fn: Callable, *args, **kwargs) -> Future:
        """fn(*args, **kwargs) on lane `lane`'s thread, after the calls submitted to it before; an argument that is
        the Future of an earlier call is its result (the earlier call's exception, if it raised)."""
        before = self._last.get(lane)

        def call(*args, **kwargs):
            if before is not None:
                before.result()  # done (the lane runs one call at a time): raises if it raised
            args = [a.result() if isinstance(a, Future) else a for a in args]
            return fn(*args, **{k: a.result() if isinstance(a, Future) else a for k, a in kwargs.items()})

        if not self._threads:
            done: Future = Future()
            done.set_result(call(*args, **kwargs))
            return done
        if lane not in self._lanes:
            self._lanes[lane] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rlake-{lane}")
        self._last[lane] = self._lanes[lane].submit(store.in_this_scope(call), *args, **kwargs)
        self._calls.append(self._last[lane])
        return self._last[lane]

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc_info) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=True)
        for call in self._calls:
            call.result()
