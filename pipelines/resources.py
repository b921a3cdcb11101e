"""Resource construction: every resource of a run, located from the config's trainer.output_dir."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from assets.resources import (ModelStoreResource, RayResource, RolloutStoreResource, RunConfigResource,
                              TrackerResource)
from configs.schema import load_config

def build_resources(config_path: str, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """All resources, with locations taken from the config's trainer.output_dir."""
    cfg = load_config(config_path, list(overrides))
    out = Path(cfg.trainer.output_dir).resolve()
    tracking = cfg.trainer.mlflow_tracking_uri or f"sqlite:///{out / 'mlflow.db'}"
    return {
        "run_config": RunConfigResource(config_path=str(config_path), overrides=list(overrides)),
        "ray": RayResource(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus),
        "rollout_store": RolloutStoreResource(root=str(out / "tables")),
        "model_store": ModelStoreResource(root=str(out / "checkpoints")),
        "tracker": TrackerResource(tracking_uri=tracking, experiment_name=cfg.trainer.project_name,
                                   artifact_root=(out / "mlartifacts").as_uri()),
    }
