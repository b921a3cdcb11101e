"""Resource construction: every resource of a run follows the config the run was launched with.

`run_config` (assets/resources.py RunConfigResource) is configured at launch: the launchpad, the chaining
sensor and `rlake train` set its config_path / overrides / config_json. The other resources are built per
Dagster run from that launched config, so a launch-time change (another trainer.output_dir, MLflow URI or
Ray address) reaches the tables, checkpoints, tracker and Ray of that run; none keeps the load-time config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg

from assets import delta_io
from assets.resources import (
    ModelStoreResource,
    RayResource,
    RolloutStoreResource,
    RunConfigResource,
    TrackerResource,
)
from configs.schema import RunConfig
from stages.io import uris
from stages.io.tracking import is_tracking_server


def tables_root(cfg: RunConfig) -> str:
    """<storage.root>/tables (default <trainer.output_dir>/tables): a storage URI (stages/io/uris.py)."""
    return uris.tables_root(cfg)


def tracker_for(cfg: RunConfig) -> TrackerResource:
    """MLflow of run `cfg`: trainer.mlflow_tracking_uri, else sqlite under trainer.output_dir.

    Artifacts (config.yaml, sample tables, the validation curve): a tracking server (http/https) decides where
    they go (its `--artifacts-destination`, proxied by the server), so rlake sets no artifact root and every
    host needs only HTTP to it. A store rlake opens itself (the sqlite default, a database URI) keeps them
    beside the run, in <trainer.output_dir>/mlartifacts: a one-host store (docs/cluster.md: a cluster uses a
    server)."""
    out = Path(cfg.trainer.output_dir).resolve()
    uri = cfg.trainer.tracking_uri
    return TrackerResource(
        tracking_uri=uri,
        experiment_name=cfg.trainer.project_name,
        artifact_root=None if is_tracking_server(uri) else (out / "mlartifacts").as_uri(),
    )


def _derived(build) -> dg.ResourceDefinition:
    """A resource built, per Dagster run, from that run's launched RunConfig."""
    return dg.ResourceDefinition(
        resource_fn=lambda ctx: build(ctx.resources.run_config.load()),
        required_resource_keys={"run_config"},
        description=build.__doc__,
    )


def _ray(cfg: RunConfig) -> RayResource:
    """Ray at ray.address (`local`: a new local cluster) for the run, with ray.runtime_env and
    ray.resources_per_worker and ray.placement_timeout_s."""
    return RayResource(
        address=cfg.ray.address,
        num_cpus=cfg.ray.num_cpus,
        run_id=cfg.run_id,
        runtime_env=dict(cfg.ray.runtime_env),
        resources_per_worker={role: dict(res) for role, res in cfg.ray.resources_per_worker.items()},
        placement_timeout_s=cfg.ray.placement_timeout_s,
    )


def _rollout_store(cfg: RunConfig) -> RolloutStoreResource:
    """Delta tables under <storage.root>/tables (default <trainer.output_dir>/tables), with storage.options."""
    root = tables_root(cfg)
    return RolloutStoreResource(root=root, storage_options=uris.storage_options(cfg, root) or {})


def _model_store(cfg: RunConfig) -> ModelStoreResource:
    """Policy and critic checkpoints committed under <storage root>/checkpoints (default
    <trainer.output_dir>/checkpoints), fetched into storage.cache_dir on the node that reads one."""
    return ModelStoreResource(
        root=uris.checkpoints_root(cfg),
        cache_dir=cfg.storage.cache_dir,
        storage_options=uris.storage_options(cfg),
        cache_keep_versions=cfg.storage.cache_keep_versions,
    )


def _tracker(cfg: RunConfig) -> TrackerResource:
    """MLflow: trainer.mlflow_tracking_uri, else sqlite under trainer.output_dir."""
    return tracker_for(cfg)


def launch_defaults(
    cfg: RunConfig | None, config_path: str = "", overrides: list[str] | tuple[str, ...] = ()
) -> dict[str, object]:
    """The run_config resource's launch-time default: the resolved `cfg` as JSON, else `config_path` +
    `overrides` (what the launchpad pre-fills, and what the sensor falls back to for fields a run left out)."""
    if cfg is not None:
        return {"config_json": RunConfigResource.of(cfg).config_json}
    return {"config_path": config_path, "overrides": list(overrides)}


def build_resources(
    cfg: RunConfig | None = None, *, config_path: str = "", overrides: list[str] | tuple[str, ...] = ()
) -> dict[str, Any]:
    """All resources of a run. The launch-time default of `run_config`: the resolved `cfg` (what `rlake train`,
    `rlake rescore` and tests pass), else `config_path` + `overrides` (the `rlake ui` code location, so the
    launchpad shows and edits the YAML path and its overrides)."""
    return {
        "run_config": RunConfigResource.configure_at_launch(**launch_defaults(cfg, config_path, overrides)),
        "ray": _derived(_ray),
        "rollout_store": _derived(_rollout_store),
        "model_store": _derived(_model_store),
        "tracker": _derived(_tracker),
        delta_io.KEY: delta_io.delta_io_manager,
    }
