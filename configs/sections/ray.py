"""The `ray` section: which cluster, runtime_env, per-role resources, placement timeout."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from configs.sections.base import _refuse_credentials, _Strict

RAY_ROLES = ("actor", "rollout", "ref", "teacher", "critic", "reward_model", "judge")
"""The worker groups a run places (stages/workers/*_worker.py); ray.resources_per_worker is keyed by them."""


class RayConfig(_Strict):
    address: str = "local"
    """`local`: a new local Ray cluster of this process (bound to 127.0.0.1; never attaches to a running one);
    `auto`: the cluster `ray start` made on this machine; `host:port` (or `ray://host:port`): that cluster's
    GCS. Any cluster (not `local`) requires Ray's token auth (RAY_AUTH_MODE=token and the token in the
    environment). null is read as `local`."""
    num_cpus: int | None = None
    """CPUs of the local cluster; None uses all."""
    runtime_env: dict[str, Any] = {}
    """Ray runtime_env forwarded to every rlake actor and task (working_dir, py_executable, pip, env_vars, ...).
    Secrets do not belong in env_vars: `env_vars_from: [NAME, ...]` copies those variables from the driver's
    environment at launch (storage credentials, HF_HUB_OFFLINE), so they never enter the config."""
    resources_per_worker: dict[str, dict[str, float]] = {}
    """Per role (actor, rollout, ref, critic, reward_model, judge) the Ray resources of each worker, e.g.
    `{actor: {CPU: 2}, rollout: {CPU: 1}}`: a role named here gets one placement group of num_workers such
    bundles (PACK; trainer rank order = bundle order) and torch threads = the bundle's CPUs. A role not named
    requests nothing (num_cpus=0, placed anywhere: the local default)."""
    placement_timeout_s: float = Field(60.0, gt=0)
    """The longest a worker group waits for Ray to place it (its placement group, ray.resources_per_worker or the
    GPU pool): after a lost node, for remaining or new capacity. Past it the stage fails with what was missing
    and `rlake train` retries the iteration (trainer.max_iteration_retries), never a silent wait."""
    data_min_rows: int | None = 50000
    """Table stages (stages/io/stage_exec.py) run on Ray Data from this many rows of their input partition on,
    else in the Dagster step's process, streamed batch by batch (Ray Data's start-up costs seconds a tiny
    iteration does not have); 0: always Ray Data (a cluster), null: never."""

    @model_validator(mode="before")
    @classmethod
    def _null_address(cls, data: Any) -> Any:
        if isinstance(data, dict) and "address" in data and data["address"] is None:
            data = {**data, "address": "local"}
        return data

    @model_validator(mode="after")
    def _check(self) -> RayConfig:
        unknown = sorted(set(self.resources_per_worker) - set(RAY_ROLES))
        if unknown:
            raise ValueError(
                f"ray.resources_per_worker names unknown roles {unknown}: it is keyed by the worker groups a run "
                f"places; use {list(RAY_ROLES)}."
            )
        for role, res in self.resources_per_worker.items():
            if not res or any(v < 0 for v in res.values()):
                raise ValueError(
                    f"ray.resources_per_worker.{role}={res} must name at least one resource with a count >= 0 "
                    "(e.g. {CPU: 1}), because it sizes that role's placement-group bundles; fix or remove it."
                )
        env_vars = self.runtime_env.get("env_vars") or {}
        _refuse_credentials("ray.runtime_env.env_vars", env_vars)
        return self

    @property
    def is_cluster(self) -> bool:
        """Attaching to a cluster (auto or an address), not a new local one."""
        return self.address != "local"
