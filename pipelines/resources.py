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

from assets.resources import (
    ModelStoreResource,
    RayResource,
    RolloutStoreResource,
    RunConfigResource,
    TrackerResource,
)
from configs.schema import RunConfig


def tables_root(cfg: RunConfig) -> str:
    return str(Path(cfg.trainer.output_dir).resolve() / "tables")


def tracker_for(cfg: RunConfig) -> TrackerResource:
    """MLflow of run `cfg`: trainer.mlflow_tracking_uri, else sqlite under trainer.output_dir."""
    out = Path(cfg.trainer.output_dir).resolve()
    return TrackerResource(
        tracking_uri=cfg.trainer.mlflow_tracking_uri or f"sqlite:///{out / 'mlflow.db'}",
        experiment_name=cfg.trainer.project_name,
        artifact_root=(out / "mlartifacts").as_uri(),
    )


def _derived(build) -> dg.ResourceDefinition:
    """A resource built, per Dagster run, from that run's launched RunConfig."""
    return dg.ResourceDefinition(
        resource_fn=lambda ctx: build(ctx.resources.run_config.load()),
        required_resource_keys={"run_config"},
        description=build.__doc__,
    )


def _ray(cfg: RunConfig) -> RayResource:
    """Ray at ray.address (a new local cluster when null)."""
    return RayResource(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus)


def _rollout_store(cfg: RunConfig) -> RolloutStoreResource:
    """Delta tables under <trainer.output_dir>/tables."""
    return RolloutStoreResource(root=tables_root(cfg))


def _model_store(cfg: RunConfig) -> ModelStoreResource:
    """Policy and critic checkpoints under <trainer.output_dir>/checkpoints."""
    return ModelStoreResource(root=str(Path(cfg.trainer.output_dir).resolve() / "checkpoints"))


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
    }
