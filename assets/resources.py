"""Dagster resources, one per external system, all real on local storage by default.

The classes live here (assets annotate with them); pipelines.resources builds them from a RunConfig."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
import yaml
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from configs.schema import RunConfig
from stages.io import store
from stages.io.checkpoints import ModelStore
from stages.io.tracking import (
    END_STATUSES,
    code_tags,
    log_lineage,
    log_validation_figure,
    log_validation_samples,
    set_status,
)
from stages.workers.group import ensure_ray

_PARSED: dict[str, RunConfig] = {}
"""sha256 of a config's JSON -> its RunConfig: each distinct config is validated once per process."""


def _digest(config_json: str) -> str:
    return hashlib.sha256(config_json.encode()).hexdigest()


class RunConfigResource(dg.ConfigurableResource):
    """The run's resolved RunConfig (bases, overrides and run id applied) as JSON, parsed once per process.

    `rlake train` and the `dagster dev` code location build it with `of(load_config(...))`, so no asset
    reads YAML or re-applies overrides; `load()` returns the same RunConfig object on every call."""

    config_json: str

    @classmethod
    def of(cls, cfg: RunConfig) -> RunConfigResource:
        """The resource holding `cfg` (this process's `load()` returns `cfg` itself: no second validation)."""
        config_json = cfg.model_dump_json()
        _PARSED[_digest(config_json)] = cfg
        return cls(config_json=config_json)

    def load(self) -> RunConfig:
        key = _digest(self.config_json)
        if key not in _PARSED:  # JSON this process did not get from `of` (e.g. edited in the launchpad)
            _PARSED[key] = RunConfig.model_validate_json(self.config_json)
        return _PARSED[key]


class RayResource(dg.ConfigurableResource):
    """A local Ray cluster (started once per process) or an existing one at `address`."""

    address: str | None = None
    num_cpus: int | None = None

    def ensure(self) -> None:
        ensure_ray(self.address, self.num_cpus)


class RolloutStoreResource(dg.ConfigurableResource):
    """Delta tables under `root` (one directory per table), partitioned by run and iteration."""

    root: str

    def uri(self, table: str) -> str:
        return str(Path(self.root) / table)

    def write(self, table: str, df: pd.DataFrame, *, run_id: str, iteration: int, lineage: dict[str, Any]) -> int:
        return store.write_partition(self.uri(table), table, df, run_id=run_id, iteration=iteration, lineage=lineage)

    def read(
        self, table: str, run_id: str, iteration: int, *, version: int | None = None, columns: list[str] | None = None
    ) -> tuple[pd.DataFrame, int]:
        """(rows, table version read); `columns`: only those."""
        uri = self.uri(table)
        version = store.table_version(uri) if version is None and store.table_exists(uri) else version
        return store.read_partition(uri, run_id, iteration, version=version, columns=columns), version


class ModelStoreResource(dg.ConfigurableResource):
    """Versioned HF-format policy checkpoints under `root`."""

    root: str

    def for_run(self, run_id: str) -> ModelStore:
        return ModelStore(self.root, run_id)


class TrackerResource(dg.ConfigurableResource):
    """MLflow: one MLflow run per rlake run (found by the tag rlake.run_id), metrics per iteration (step =
    policy version), Delta lineage as dataset inputs, validation samples, and a status that ends.

    Status: logging a step the run has not logged yet reopens an ended run (RUNNING: a resumed run);
    re-logging an already-logged step (re-materializing an old partition) leaves the status alone;
    end_run sets FINISHED (the last iteration), FAILED or KILLED (rlake train on an error / Ctrl-C)."""

    tracking_uri: str
    experiment_name: str = "rlake"
    artifact_root: str | None = None
    """Where the experiment's artifacts go (else MLflow's default, ./mlruns of the current directory)."""

    def _client(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.tracking_uri)

    def _find(self, client, run_id: str, *, create_experiment: bool):
        """(experiment id, the MLflow run of rlake run `run_id` or None)."""
        exp = client.get_experiment_by_name(self.experiment_name)
        if exp is None and not create_experiment:
            return None, None
        exp_id = (
            exp.experiment_id
            if exp
            else client.create_experiment(self.experiment_name, artifact_location=self.artifact_root)
        )
        found = client.search_runs([exp_id], filter_string=f"tags.`rlake.run_id` = '{run_id}'", max_results=1)
        return exp_id, (found[0] if found else None)

    def run_for(self, run_id: str, cfg: RunConfig | None = None, *, step: int | None = None) -> str:
        """The MLflow run id of rlake run `run_id`, created (with params, config, git commit) on first use.

        With `step` (the step about to be logged): an ended run is reopened unless it already logged
        that step, and the tag rlake.last_step keeps the highest step seen."""
        client = self._client()
        exp_id, found = self._find(client, run_id, create_experiment=True)
        if found is not None:
            last = int(found.data.tags.get("rlake.last_step", -1))
            if found.info.status != "RUNNING" and (step is None or step > last):
                set_status(client, found.info.run_id, "RUNNING")
            if step is not None and step > last:
                client.set_tag(found.info.run_id, "rlake.last_step", str(step))
            return found.info.run_id
        tags = {"rlake.run_id": run_id, **code_tags(), **({"rlake.last_step": str(step)} if step is not None else {})}
        run = client.create_run(exp_id, run_name=run_id, tags=tags)
        if cfg is not None:
            flat = pd.json_normalize(cfg.model_dump(mode="json"), sep=".").iloc[0].to_dict()
            params = [(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v)) for k, v in sorted(flat.items())]
            for i in range(0, len(params), 100):
                client.log_batch(run.info.run_id, params=[Param(k, v[:6000]) for k, v in params[i : i + 100]])
            client.log_text(
                run.info.run_id, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), "config.yaml"
            )
            client.set_tag(run.info.run_id, "rlake.config_hash", cfg.config_hash())
        return run.info.run_id

    def log_metrics(self, mlflow_run_id: str, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        items = [Metric(k.replace("@", "_at_"), float(v), now, step) for k, v in sorted(metrics.items())]
        client = self._client()
        for i in range(0, len(items), 500):
            client.log_batch(mlflow_run_id, metrics=items[i : i + 500])

    def log_iteration(
        self,
        mlflow_run_id: str,
        tables_root: str,
        run_id: str,
        iteration: int,
        *,
        metrics_version: int,
        policy_version: int,
        validation: dict[str, pd.DataFrame] | None = None,
    ) -> None:
        """After the iteration's iteration_metrics write: its Delta table versions as dataset inputs and,
        when it validated, samples/val_step_<policy_version>.json (stages.io.tracking)."""
        client = self._client()
        log_lineage(client, mlflow_run_id, tables_root, run_id, iteration, metrics_version=metrics_version)
        if validation is not None:
            log_validation_samples(
                client, mlflow_run_id, validation, policy_version=policy_version, metrics_version=metrics_version
            )

    def end_run(self, rlake_run_id: str, status: str, *, tables_root: str | None = None) -> str | None:
        """End the MLflow run of rlake run `rlake_run_id` with status FINISHED, FAILED or KILLED; with
        tables_root, first log validation_curve.png from its iteration_metrics table. Returns the MLflow
        run id, None when the rlake run never logged to MLflow (nothing to end)."""
        if status not in END_STATUSES:
            raise ValueError(f"end_run status '{status}' is not an end status. Valid: {list(END_STATUSES)}")
        client = self._client()
        _, found = self._find(client, rlake_run_id, create_experiment=False)
        if found is None:
            return None
        if tables_root is not None:
            log_validation_figure(client, found.info.run_id, tables_root, rlake_run_id)
        set_status(client, found.info.run_id, status)
        return found.info.run_id
