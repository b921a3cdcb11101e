"""Dagster resources, one per external system, all real on local storage by default.

The classes live here (assets annotate with them); pipelines.resources builds them from a config."""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd

from configs.schema import RunConfig, load_config
from stages import store
from stages.checkpoints import ModelStore


@lru_cache(maxsize=16)
def _load(path: str, overrides: tuple[str, ...]) -> RunConfig:
    return load_config(path, overrides)


class RunConfigResource(dg.ConfigurableResource):
    """The rlake RunConfig: a YAML path plus key.sub=value overrides."""

    config_path: str
    overrides: list[str] = []

    def load(self) -> RunConfig:
        return _load(self.config_path, tuple(self.overrides))


class RayResource(dg.ConfigurableResource):
    """A local Ray cluster (started once per process) or an existing one at `address`."""

    address: str | None = None
    num_cpus: int | None = None

    def ensure(self) -> None:
        import ray

        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_ACCEPT_CLOUD_SDK_WARNING", "1")
        ray.init(address=self.address, num_cpus=None if self.address else self.num_cpus,
                 include_dashboard=False, log_to_driver=False, configure_logging=False)
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False


class RolloutStoreResource(dg.ConfigurableResource):
    """Delta tables under `root` (one directory per table), partitioned by run and iteration."""

    root: str

    def uri(self, table: str) -> str:
        return str(Path(self.root) / table)

    def write(self, table: str, df: pd.DataFrame, *, run_id: str, iteration: int, lineage: dict[str, Any]) -> int:
        return store.write_partition(self.uri(table), table, df, run_id=run_id, iteration=iteration, lineage=lineage)

    def read(self, table: str, run_id: str, iteration: int, *, version: int | None = None) -> tuple[pd.DataFrame, int]:
        """(rows, table version read)."""
        uri = self.uri(table)
        version = store.table_version(uri) if version is None and store.table_exists(uri) else version
        return store.read_partition(uri, run_id, iteration, version=version), version


class ModelStoreResource(dg.ConfigurableResource):
    """Versioned HF-format policy checkpoints under `root`."""

    root: str

    def for_run(self, run_id: str) -> ModelStore:
        return ModelStore(self.root, run_id)


class TrackerResource(dg.ConfigurableResource):
    """MLflow: one MLflow run per rlake run (found by the tag rlake.run_id), metrics per iteration."""

    tracking_uri: str
    experiment_name: str = "rlake"
    artifact_root: str | None = None
    """Where the experiment's artifacts go (else MLflow's default, ./mlruns of the current directory)."""

    def _client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri)

    def run_for(self, run_id: str, cfg: RunConfig | None = None) -> str:
        """The MLflow run id of rlake run `run_id`, created (with params and config) on first use."""
        client = self._client()
        exp = client.get_experiment_by_name(self.experiment_name)
        exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment_name,
                                                                         artifact_location=self.artifact_root)
        found = client.search_runs([exp_id], filter_string=f"tags.`rlake.run_id` = '{run_id}'", max_results=1)
        if found:
            return found[0].info.run_id
        run = client.create_run(exp_id, run_name=run_id, tags={"rlake.run_id": run_id})
        if cfg is not None:
            flat = pd.json_normalize(cfg.model_dump(mode="json"), sep=".").iloc[0].to_dict()
            params = [(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v)) for k, v in sorted(flat.items())]
            from mlflow.entities import Param
            for i in range(0, len(params), 100):
                client.log_batch(run.info.run_id, params=[Param(k, v[:6000]) for k, v in params[i:i + 100]])
            import yaml
            client.log_text(run.info.run_id, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), "config.yaml")
            client.set_tag(run.info.run_id, "rlake.config_hash", cfg.config_hash())
        return run.info.run_id

    def log_metrics(self, mlflow_run_id: str, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k.replace("@", "_at_"), float(v), now, step) for k, v in sorted(metrics.items())]
        client = self._client()
        for i in range(0, len(items), 500):
            client.log_batch(mlflow_run_id, metrics=items[i:i + 500])
