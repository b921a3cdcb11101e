"""The stage assets, generated from stages/dag.py: one asset per row, nothing written by hand but its body.

For row `name` the asset gets the row's partitions (set-up: per run; iteration: per run x iteration), group,
kinds and checks; its inputs are the row's upstream tables, loaded by the Delta IO manager (assets/delta_io.py)
as partition handles at their recorded versions, and its other upstream stages are plain deps. It runs
`materialize(run)` of assets/<name>.py with a StageRun: the launched config, the iteration, the inputs, the
resources and the row's compute function (stages/<name>.py). A stage the run's config does not have
(`when` false) writes nothing and returns at once (assets.common.outside_dag).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import dagster as dg
import pandas as pd

from assets import delta_io
from assets.common import (
    asset_deps,
    check_spec,
    checkpoint_version,
    data_version,
    lineage,
    outside_dag,
    run_iterations,
    runs,
    upstream_partition,
    write_table,
)
from configs.schema import RunConfig
from stages.dag import ITERATION, SETUP, Stage
from stages.io.stage_exec import Partition
from stages.io.tables import PROMPTS_ITERATION
from stages.workers.shard_io import ShardResult, Sink
from stages.workers.sharded import commit_shards

RESOURCES = frozenset({"run_config", "rollout_store", "model_store", "ray", "tracker"})
"""What every stage body may use (built per Dagster run from its launched config: pipelines/resources.py)."""


@dataclass
class StageRun:
    """One materialization of a stage: what its body (assets/<name>.py `materialize`) works with."""

    context: dg.AssetExecutionContext
    stage: Stage
    cfg: RunConfig
    inputs: dict[str, Partition | None]
    """The row's upstream tables, as handles at their recorded versions (None: a stage the run does not have)."""
    compute: Callable
    """The row's compute function (stages/<name>.py)."""
    started: float = field(default_factory=time.perf_counter)

    @property
    def iteration(self) -> int:
        """The iteration of an iteration asset's partition (PROMPTS_ITERATION for a set-up asset)."""
        if self.stage in SETUP:
            return PROMPTS_ITERATION
        return int(self.context.partition_key.keys_by_dimension["iteration"])

    def __getattr__(self, name: str):
        """The resources by name: run.rollout_store, run.model_store, run.ray, run.tracker."""
        if name in RESOURCES:
            return getattr(self.context.resources, name)
        raise AttributeError(name)

    @property
    def log(self):
        return self.context.log

    def seconds(self) -> float:
        """Seconds since the body started."""
        return time.perf_counter() - self.started

    def frame(self, name: str) -> tuple[pd.DataFrame, int]:
        """(rows, version) of input `name` read whole (a small table: prompts, a prompt batch)."""
        part = self.inputs[name]
        rows, _ = self.rollout_store.read(name, part.run_id, part.iteration, version=part.version)
        return rows, part.version

    def partition(self, table: str, iteration: int | None = None) -> Partition:
        """A table this stage reads besides its inputs (default: this iteration's partition), at its recorded
        version, as the IO manager loads an input."""
        it = self.iteration if iteration is None else iteration
        return upstream_partition(self.context, self.rollout_store, table, self.cfg.run_id, it)

    def lineage(self, upstream: dict, *, policy_version: int | None, duration_s: float | None = None) -> dict:
        """The commit metadata of this stage's write (assets.common.lineage), timed from the body's start."""
        seconds = self.seconds() if duration_s is None else duration_s
        return lineage(self.cfg, stage=self.stage.name, policy_version=policy_version, upstream=upstream,
                       duration_s=seconds)  # fmt: skip

    def sink(self) -> Sink:
        """Where this stage's workers write their files of its partition."""
        return Sink(self.rollout_store.uri(self.stage.name), self.stage.name, self.cfg.run_id, self.iteration)

    def commit(self, sink: Sink, results: list[ShardResult], meta: dict) -> int:
        """ONE Delta commit of the files the workers wrote to `sink`, with lineage `meta`; the new version."""
        return commit_shards(sink, results, meta)

    def write(self, rows: pd.DataFrame, *, upstream: dict, policy_version: int | None, **kwargs) -> int:
        """Write this stage's partition from this process (kwargs: another `table`/`iteration`, `duration_s`)."""
        table = kwargs.pop("table", self.stage.name)
        iteration = kwargs.pop("iteration", self.iteration)
        kwargs.setdefault("duration_s", self.seconds())
        kwargs.setdefault("stage", self.stage.name)
        return write_table(self.rollout_store, self.cfg, table, rows, iteration, policy_version=policy_version,
                           upstream=upstream, **kwargs)  # fmt: skip

    def model_pass(self, model_version: int) -> tuple[list[ShardResult], int, float]:
        """The body of the stages that run a checkpoint over the iteration's rollouts (ref_logprobs, old_logprobs,
        teacher_logprobs): version `model_version` of the run required, compute(cfg, rollouts, model_dir, sink) on
        Ray (each rank reads its slice of the rollouts input and writes its rows: stages/workers/sharded.py), then
        ONE commit with the rollouts as upstream. Returns (the ranks' results, the new version, seconds)."""
        it, source = self.iteration, self.inputs["rollouts"]
        needed_by = f"{self.stage.name} of iteration {it}"
        model_dir = self.model_store.for_run(self.cfg.run_id).require(model_version, needed_by=needed_by)
        self.ray.ensure()
        sink, t0 = self.sink(), time.perf_counter()
        results = self.compute(self.cfg, source, model_dir, sink)
        seconds = time.perf_counter() - t0
        meta = self.lineage({"rollouts": source.version}, policy_version=it, duration_s=seconds)
        return results, self.commit(sink, results, meta), seconds

    def result(self, version: int, metadata: dict, checks: list[dg.AssetCheckResult] = ()) -> dg.MaterializeResult:
        """The materialization of a table stage that wrote Delta `version` of its table."""
        return dg.MaterializeResult(
            metadata={"delta_version": version, **metadata},
            data_version=data_version(self.stage.name, version),
            check_results=list(checks),
        )

    def checkpoint_result(
        self, kind: str, version: int, metadata: dict, checks: list[dg.AssetCheckResult] = ()
    ) -> dg.MaterializeResult:
        """The materialization of a checkpoint stage that committed `kind` version `version`."""
        return dg.MaterializeResult(
            metadata=metadata, data_version=checkpoint_version(kind, version, self.context), check_results=list(checks)
        )


def compute_function(stage: Stage) -> Callable:
    """The row's compute function: `stage.compute` of stages/<name>.py."""
    module = importlib.import_module(f"stages.{stage.name}")
    return getattr(module, stage.compute)


def body(stage: Stage) -> Callable[[StageRun], dg.MaterializeResult]:
    """The asset's body: `materialize` of assets/<name>.py."""
    return importlib.import_module(f"assets.{stage.name}").materialize


def _ins(stage: Stage) -> dict[str, dg.AssetIn]:
    """The row's upstream tables as inputs (through the run dimension when a set-up table feeds an iteration
    asset: the same mapping as its deps)."""
    deps = {d.asset_key.to_user_string(): d for d in asset_deps(stage.name)}
    return {
        up: dg.AssetIn(key=up, partition_mapping=deps[up].partition_mapping, input_manager_key=delta_io.KEY)
        for up in stage.inputs
    }


def stage_asset(stage: Stage) -> dg.AssetsDefinition:
    """The Dagster asset of one row of stages/dag.py."""
    materialize, compute = body(stage), compute_function(stage)
    checks = tuple(c.name for c in stage.checks)

    @dg.asset(
        name=stage.name,
        partitions_def=runs if stage in SETUP else run_iterations,
        group_name=stage.group,
        kinds=set(stage.kinds),
        ins=_ins(stage),
        deps=[d for d in asset_deps(stage.name) if d.asset_key.to_user_string() not in stage.inputs],
        check_specs=[
            check_spec(c.name, asset=stage.name, blocking=c.blocking, description=c.description or None)
            for c in stage.checks
        ],
        required_resource_keys=set(RESOURCES),
        description=materialize.__doc__,
    )
    def _asset(context, **inputs):  # context: dg.AssetExecutionContext; inputs: Partition | None
        cfg = context.resources.run_config.load()
        if skipped := outside_dag(cfg, stage.name, checks):
            return skipped
        return materialize(StageRun(context, stage, cfg, inputs, compute))

    return _asset


def stage_assets() -> list[dg.AssetsDefinition]:
    """Every stage's asset, in the order of stages/dag.py."""
    return [stage_asset(s) for s in SETUP + ITERATION]
