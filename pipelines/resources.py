"""Resource construction: every resource of a run, located from the config's trainer.output_dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from assets.resources import (
    ModelStoreResource,
    RayResource,
    RolloutStoreResource,
    RunConfigResource,
    TrackerResource,
)
from configs.schema import RunConfig


def build_resources(cfg: RunConfig) -> dict[str, Any]:
    """All resources of the run `cfg` (its resolved config, run id included), located under trainer.output_dir."""
    out = Path(cfg.trainer.output_dir).resolve()
    tracking = cfg.trainer.mlflow_tracking_uri or f"sqlite:///{out / 'mlflow.db'}"
    return {
        "run_config": RunConfigResource.of(cfg),
        "ray": RayResource(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus),
        "rollout_store": RolloutStoreResource(root=str(out / "tables")),
        "model_store": ModelStoreResource(root=str(out / "checkpoints")),
        "tracker": TrackerResource(
            tracking_uri=tracking,
            experiment_name=cfg.trainer.project_name,
            artifact_root=(out / "mlartifacts").as_uri(),
        ),
    }
