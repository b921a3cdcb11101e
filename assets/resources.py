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
from pydantic import PrivateAttr, ValidationError

from configs import compose
from configs.errors import explain_config_error
from configs.schema import RunConfig
from stages.io import store, uris
from stages.io.checkpoints import ModelStore
from stages.io.mlflow_seed import seed_sqlite_store
from stages.io.tracking import (
    END_STATUSES,
    ERROR_TAG,
    MAX_ERROR_CHARS,
    code_tags,
    log_lineage,
    log_validation_figure,
    log_validation_samples,
    set_status,
)
from stages.metric_names import mlflow_metric_name
from stages.workers.group import ensure_ray

_PARSED: dict[str, RunConfig] = {}
"""sha256 of (config source, run id) -> its RunConfig: each distinct launched config is validated once per process."""

RUN_TAG = "dagster/partition/run"
"""The tag Dagster gives a run of a run x iteration partition: the rlake run id."""


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def partition_run_id(tags: dict[str, str]) -> str | None:
    """The rlake run id of a Dagster run's partition: its run dimension (iteration jobs) or the whole key
    (the set-up job, partitioned by run); None for an unpartitioned run."""
    if RUN_TAG in tags:
        return tags[RUN_TAG]
    key = tags.get("dagster/partition")
    return key if key is not None and "|" not in key else None


class RunConfigResource(dg.ConfigurableResource):
    """The run's RunConfig, set when a run is launched (the launchpad, the chaining sensor, `rlake train`).

    Either `config_json` (a resolved config: what `rlake train` passes, so every Dagster run records the
    exact config it ran with) or `config_path` (a YAML file, bases composed, relative to the working
    directory of the code location: the repository root for `rlake ui`), then `overrides`
    (`key.sub=value`, values as YAML) on top. The run id is the partition's `run`: a config whose
    trainer.run_id names another run is refused. Every other resource (tables, checkpoints, MLflow, Ray)
    and every stage of the run reads this one config (pipelines/resources.py), and the run fails at start
    with rlake's what/why/fix message when the config does not validate."""

    config_path: str = ""
    overrides: list[str] = []
    config_json: str = ""
    _run_id: str | None = PrivateAttr(default=None)

    @classmethod
    def of(cls, cfg: RunConfig) -> RunConfigResource:
        """The resource holding `cfg` (this process's `load()` returns `cfg` itself: no second validation)."""
        res = cls(config_json=cfg.model_dump_json())
        _PARSED[res._key(None)] = cfg
        if cfg.trainer.run_id is not None:  # what a run of its own partition resolves to
            _PARSED[res._key(cfg.trainer.run_id)] = cfg
        return res

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """Bind the run id of the launched partition and validate now, so a bad config fails the run at start."""
        self._run_id = partition_run_id(dict(context.dagster_run.tags)) if context.dagster_run else None
        self.load()

    def _key(self, run_id: str | None) -> str:
        return _digest(self.config_json, self.config_path, list(self.overrides), run_id)

    def load(self) -> RunConfig:
        """The validated RunConfig of the launched run (its trainer.run_id = the partition's run)."""
        key = self._key(self._run_id)
        if key not in _PARSED:
            _PARSED[key] = resolve_run_config(
                self.config_json, self.config_path, list(self.overrides), run_id=self._run_id
            )
        return _PARSED[key]


def resolve_run_config(
    config_json: str, config_path: str, overrides: list[str], *, run_id: str | None = None
) -> RunConfig:
    """The RunConfig of a launch: `config_json` or `config_path` as the base, `overrides` on top, trainer.run_id
    set to `run_id` (the launched partition's run). What/why/fix ValueError when it does not validate."""
    if not config_json and not config_path:
        raise ValueError(
            "the run_config resource has neither config_path nor config_json: a run needs its rlake config; set "
            "resources.run_config.config.config_path (e.g. configs/tiny_cpu.yaml) in the launchpad"
        )
    try:
        tree = json.loads(config_json) if config_json else compose.load_tree(config_path, RunConfig)
        tree = compose.apply_overrides(tree, overrides, RunConfig)
        compose.check_known_keys(tree, RunConfig)
        cfg = RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise explain_config_error(exc) from None
    except FileNotFoundError as exc:
        raise ValueError(
            f"config_path '{config_path}' does not exist ({exc}): the launched run_config resource names its YAML "
            f"relative to the code location's working directory ({Path.cwd()}); give an absolute path or one "
            "relative to it, e.g. configs/tiny_cpu.yaml"
        ) from None
    if run_id is None:
        return cfg
    if cfg.trainer.run_id not in (None, run_id):
        raise ValueError(
            f"the launched config says trainer.run_id={cfg.trainer.run_id!r} but the run was launched for partition "
            f"run={run_id!r}: a run's tables, checkpoints and MLflow run are keyed by its run id, so the two must "
            f"agree; drop trainer.run_id from the config (the partition names the run) or launch partition "
            f"run={cfg.trainer.run_id!r}"
        )
    return cfg.with_run_id(run_id)


class RayResource(dg.ConfigurableResource):
    """Ray for run `run_id`: a new loopback-only local cluster (address `local`, started once per process) or
    the cluster at `address` (token auth required). `runtime_env` is ray.runtime_env as configured (env var
    names only: `env_vars_from` is read from the environment when connecting, so no secret enters the
    resource's config); `resources_per_worker` places the roles it names, each placement group waited for at most
    `placement_timeout_s` (stages/workers/connect.py)."""

    address: str | None = "local"
    num_cpus: int | None = None
    run_id: str | None = None
    runtime_env: dict[str, Any] = {}
    resources_per_worker: dict[str, dict[str, float]] = {}
    placement_timeout_s: float = 60.0

    def ensure(self) -> None:
        ensure_ray(
            self.address,
            self.num_cpus,
            run_id=self.run_id,
            runtime_env=self.runtime_env,
            resources_per_worker=self.resources_per_worker,
            placement_timeout_s=self.placement_timeout_s,
        )


class RolloutStoreResource(dg.ConfigurableResource):
    """Delta tables under `root` (one table per name under it), partitioned by run and iteration.

    `root` is a storage URI (a local directory or `s3://bucket/prefix/tables`, stages/io/uris.py) opened with
    `storage_options` (storage.options: endpoint, region, allow_http; credentials stay in the environment).
    `uri(table)` and `location` carry the options (a StorageURI), so code handed one (asset helpers, a
    worker's request, the tracker) opens the table the same way."""

    root: str
    storage_options: dict[str, str] = {}

    @property
    def location(self) -> str:
        """The tables root, carrying the storage options (none for a local root)."""
        return uris.with_options(uris.normalize(self.root), uris.options_of(self.root, self.storage_options))

    def uri(self, table: str) -> str:
        return uris.join(self.location, table)

    def exists(self, table: str) -> bool:
        return store.table_exists(self.uri(table))

    def lineage(self, table: str, *, run_id: str | None = None, iteration: int | None = None) -> list[dict[str, Any]]:
        """Commit lineage of `table` (newest first; [] when the table does not exist)."""
        uri = self.uri(table)
        return store.commit_lineage(uri, run_id=run_id, iteration=iteration) if store.table_exists(uri) else []

    def write(self, table: str, df: pd.DataFrame, *, run_id: str, iteration: int, lineage: dict[str, Any]) -> int:
        return store.write_partition(self.uri(table), table, df, run_id=run_id, iteration=iteration, lineage=lineage)

    def read(
        self, table: str, run_id: str, iteration: int, *, version: int | None = None, columns: list[str] | None = None
    ) -> tuple[pd.DataFrame, int]:
        """(rows, table version read); `columns`: only those."""
        return store.read_partition_at(self.uri(table), run_id, iteration, version=version, columns=columns)


class ModelStoreResource(dg.ConfigurableResource):
    """Committed HF-format policy and critic checkpoints under `root` (a directory or a storage URI such as
    s3://bucket/prefix/checkpoints; stages.io.checkpoints), fetched into `cache_dir` on the node that reads one."""

    root: str
    cache_dir: str | None = None
    """storage.cache_dir: the node-local cache of fetched checkpoints (None: ~/.cache/rlake/checkpoints)."""
    storage_options: dict[str, str] | None = None
    """storage.options (non-secret: endpoint, region, allow_http); credentials come from the environment."""
    cache_keep_versions: int = 3
    """storage.cache_keep_versions: versions per run and kind the node's cache keeps."""

    def for_run(self, run_id: str) -> ModelStore:
        kw = {"cache_dir": self.cache_dir, "options": self.storage_options, "keep_versions": self.cache_keep_versions}
        return ModelStore(self.root, run_id, **kw)


_MLFLOW_RUNS: dict[tuple[str, str, str], dict[str, Any]] = {}
"""(tracking URI, experiment, rlake run id) -> the MLflow run's id, status and rlake.last_step, as this process last
set or found them (TrackerResource.run_for; end_run forgets the run, whose status it changes). A run deleted or
ended from outside while this process logs to it is not noticed until the process ends."""


class TrackerResource(dg.ConfigurableResource):
    """MLflow: one MLflow run per rlake run (found by the tag rlake.run_id), metrics per iteration (step =
    policy version), Delta lineage as dataset inputs, validation samples, and a status that ends.

    Status: logging a step the run has not logged yet reopens an ended run (RUNNING: a resumed run);
    re-logging an already-logged step (re-materializing an old partition) leaves the status alone;
    end_run sets FINISHED (the last iteration), FAILED or KILLED (rlake train on an error / Ctrl-C)."""

    tracking_uri: str
    experiment_name: str = "rlake"
    artifact_root: str | None = None
    """Where a new experiment's artifacts go. None with a tracking server (http/https): the server decides (its
    proxied `--artifacts-destination`, e.g. s3://bucket/mlartifacts), which is the only root every host can
    write; pipelines.resources.tracker_for sets <trainer.output_dir>/mlartifacts for a store it opens itself
    (sqlite). An experiment that already exists keeps the root it was created with."""

    def _client(self) -> MlflowClient:
        seed_sqlite_store(self.tracking_uri)  # a new sqlite store: a copy of a migrated one (1.5 s -> 0.03 s)
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
        that step, and the tag rlake.last_step keeps the highest step seen. The process remembers the run (its id,
        status and last step: _MLFLOW_RUNS) after one search, so later iterations do not search again: MLflow's
        search returns a run with all of its dataset inputs, which grow by one iteration's tables each iteration."""
        client, key = self._client(), (self.tracking_uri, self.experiment_name, run_id)
        known = _MLFLOW_RUNS.get(key)
        if known is None:
            exp_id, found = self._find(client, run_id, create_experiment=True)
            if found is None:
                known = {"id": self._create(client, exp_id, run_id, cfg, step), "status": "RUNNING"}
                known["last_step"] = -1 if step is None else step
            else:
                known = {"id": found.info.run_id, "status": found.info.status}
                known["last_step"] = int(found.data.tags.get("rlake.last_step", -1))
            _MLFLOW_RUNS[key] = known
        if known["status"] != "RUNNING" and (step is None or step > known["last_step"]):
            set_status(client, known["id"], "RUNNING")
            known["status"] = "RUNNING"
        if step is not None and step > known["last_step"]:
            client.set_tag(known["id"], "rlake.last_step", str(step))
            known["last_step"] = step
        return known["id"]

    def _create(self, client, exp_id: str, run_id: str, cfg: RunConfig | None, step: int | None) -> str:
        """A new MLflow run for rlake run `run_id`: its tags, and with `cfg` its params, config.yaml and hash."""
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
        items = [Metric(mlflow_metric_name(k), float(v), now, step) for k, v in sorted(metrics.items())]
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

    def end_run(
        self, rlake_run_id: str, status: str, *, tables_root: str | None = None, error: str | None = None
    ) -> str | None:
        """End the MLflow run of rlake run `rlake_run_id` with status FINISHED, FAILED or KILLED; with
        tables_root, first log validation_curve.png from its iteration_metrics table; with `error` (what ended
        it), tag rlake.error (FINISHED removes an earlier one). Returns the MLflow run id, None when the rlake run
        never logged to MLflow (nothing to end)."""
        if status not in END_STATUSES:
            raise ValueError(f"end_run status '{status}' is not an end status. Valid: {list(END_STATUSES)}")
        client = self._client()
        _MLFLOW_RUNS.pop((self.tracking_uri, self.experiment_name, rlake_run_id), None)  # its status changes here
        _, found = self._find(client, rlake_run_id, create_experiment=False)
        if found is None:
            return None
        if tables_root is not None:
            log_validation_figure(client, found.info.run_id, tables_root, rlake_run_id)
        if error is not None:
            client.set_tag(found.info.run_id, ERROR_TAG, error[:MAX_ERROR_CHARS])
        elif status == "FINISHED" and ERROR_TAG in found.data.tags:  # a resumed run that failed before
            client.delete_tag(found.info.run_id, ERROR_TAG)
        set_status(client, found.info.run_id, status)
        return found.info.run_id
