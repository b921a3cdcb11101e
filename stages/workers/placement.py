"""Where each role's workers run: the GPUs they request, their placement-group bundle, their torch device.

Config (verl's names): `trainer.n_gpus_per_node` x `trainer.nnodes` GPUs form the run's GPU pool. 0 GPUs
per node (the default) is a CPU run: no worker requests a GPU, no placement group is made, every tensor
stays on the CPU, and nothing differs from a run without this module.

With GPUs every role is colocated on the pool, as verl's hybrid engine colocates actor, rollout and
reference on each GPU:
- one placement group per node of `n_gpus_per_node` bundles `{"GPU": 1}`, strategy STRICT_PACK (all bundles
  of a node's group on one node), detached and named `rlake-gpus:<n>x<nnodes>:<node>` so every stage of
  the run (and a later process of it) finds the same one;
- rank i of any role goes to GPU i of the pool: node i // n_gpus_per_node, bundle i % n_gpus_per_node,
  so the trainer's process-group rank order is the bundle order;
- each worker requests GPU_SHARE = 1 / len(GPU_ROLES) of its GPU, so the rank i of every role fits on
  GPU i together (Ray's GPU count is bookkeeping; memory is shared by the engine's
  rollout.gpu_memory_utilization and vLLM's sleep mode, stages/models/engines/vllm_engine.py).

Per role, `ray.resources_per_worker` (e.g. `{actor: {CPU: 4, GPU: 1}, rollout: {CPU: 2}}`) gives a role a
placement group of its own: num_workers bundles of those resources, strategy PACK (as few nodes as fit, rank
i = bundle i, so the trainer's rank order is the bundle order), detached and named `rlake:<run>:<role>`
(`role_group_name`), made again when the role's bundles change and removed with the run's workers
(stages/workers/group.py gc_run). Each rank requests its whole bundle and runs torch on the bundle's CPUs
(`bundle_threads`). A role not named there requests nothing (num_cpus=0, anywhere: the local default).
With both set, ray.resources_per_worker wins for the roles it names and the GPU pool places the other roles;
on a GPU run (trainer.n_gpus_per_node > 0) a named role must request its own GPU, else it would silently
leave the GPUs it was given, and that is refused (`rank_placements`).

Inside a worker Ray sets CUDA_VISIBLE_DEVICES to its one GPU, so its device is cuda:0 (`worker_device`);
without CUDA (a Ray cluster declaring fake GPUs, as the CPU tests do, or a CPU-only torch) it is the CPU
whatever Ray assigned, and the process group is gloo instead of NCCL (`collective_backend`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
import torch

from configs.schema import TrainerConfig

log = logging.getLogger(__name__)

GPU_ROLES = ("actor", "rollout", "ref", "teacher", "critic", "reward_model", "judge")
"""The worker groups that may hold a model on a GPU (stages/workers/*_worker.py)."""
GPU_SHARE = 1.0 / len(GPU_ROLES)
"""Ray GPUs each worker of a GPU run requests: a rank of every role fits on one GPU."""
PG_PREFIX = "rlake-gpus:"
PG_READY_TIMEOUT_S = 60.0
"""Default of ray.placement_timeout_s: how long a placement group may wait for nodes before the stage fails."""
RAY_KEYS = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}
"""Resources that are actor options of their own; any other name goes to `resources`."""


class PlacementTimeoutError(RuntimeError):
    """A placement group was not placed within ray.placement_timeout_s: the cluster lacks the capacity, e.g.
    after losing a node. `rlake train` counts it as a lost worker and retries the iteration
    (trainer.max_iteration_retries), so capacity that comes back in time is used."""


def role_group_name(run_id: str, role: str) -> str:
    """Name of the placement group of a role named in ray.resources_per_worker."""
    return f"rlake:{run_id}:{role}"


def bundle_of(resources: Mapping[str, float]) -> dict[str, float]:
    """One rank's bundle: the role's resources with zero counts left out (Ray refuses empty bundles)."""
    bundle = {k: float(v) for k, v in resources.items() if v > 0}
    if not bundle:
        raise ValueError(
            f"ray.resources_per_worker role resources {dict(resources)} count nothing, so the role's placement-group "
            "bundles would be empty; give at least one resource a count > 0 (e.g. {CPU: 1}) or remove the role."
        )
    return bundle


def bundle_threads(resources: Mapping[str, float], default: int) -> int:
    """torch threads of a rank placed in a bundle of `resources`: its CPUs (at least 1); `default` without CPU."""
    cpus = resources.get("CPU")
    return default if not cpus else max(1, int(cpus))


@dataclass(frozen=True)
class GpuPool:
    """trainer.n_gpus_per_node x trainer.nnodes; the default (0 GPUs) is a CPU run."""

    n_gpus_per_node: int = 0
    nnodes: int = 1

    @classmethod
    def of(cls, trainer: TrainerConfig) -> GpuPool:
        """The pool of the run config's trainer section."""
        return cls(trainer.n_gpus_per_node, trainer.nnodes)

    @property
    def size(self) -> int:
        return self.n_gpus_per_node * self.nnodes

    def node_group_name(self, node: int) -> str:
        return f"{PG_PREFIX}{self.n_gpus_per_node}x{self.nnodes}:{node}"


CPU_ONLY = GpuPool()


@dataclass(frozen=True)
class RankPlacement:
    """How one rank's actor is created: Ray GPUs requested and, on GPUs, its placement group and bundle."""

    num_gpus: float = 0.0
    pool: GpuPool | None = None
    """The GPU pool whose node `node` placement group holds the rank; None on CPU."""
    node: int = 0
    bundle_index: int = -1
    resources: tuple[tuple[str, float], ...] = ()
    """The rank's bundle in its role's own placement group (ray.resources_per_worker); () otherwise."""
    group: str | None = None
    """Name of the role's own placement group (role_group_name); None otherwise."""

    @property
    def placement_group(self) -> str | None:
        """Name of the rank's placement group: its role's own, the GPU pool node's, or None."""
        if self.group is not None:
            return self.group
        return None if self.pool is None else self.pool.node_group_name(self.node)


def rank_placements(
    pool: GpuPool,
    role: str,
    num_workers: int,
    *,
    resources: Mapping[str, float] | None = None,
    group: str | None = None,
) -> list[RankPlacement]:
    """The placement of each of `num_workers` ranks of `role`: bundle i of the role's own placement group
    `group` when ray.resources_per_worker names it (`resources`), else GPU i of `pool` (see the module docstring)."""
    if resources:
        if pool.size and not resources.get("GPU"):
            raise ValueError(
                f"ray.resources_per_worker.{role}={dict(resources)} requests no GPU, but trainer.n_gpus_per_node="
                f"{pool.n_gpus_per_node} makes this a GPU run whose pool gives every '{role}' rank a GPU; a role named "
                "in ray.resources_per_worker leaves the pool, so it would run on the CPU. Add GPU: 1 (or a share) to "
                f"ray.resources_per_worker.{role}, or remove {role} from it to keep the role on the pool's GPUs."
            )
        bundle = tuple(sorted(bundle_of(resources).items()))
        name = group or role_group_name("-", role)
        gpus = dict(bundle).get("GPU", 0.0)
        return [RankPlacement(gpus, None, 0, i, bundle, name) for i in range(num_workers)]
    if role not in GPU_ROLES and pool.size:
        raise ValueError(f"Unknown GPU role '{role}'. Valid: {list(GPU_ROLES)}")
    if not pool.size:
        return [RankPlacement() for _ in range(num_workers)]
    if num_workers > pool.size:
        raise ValueError(
            f"the '{role}' group has {num_workers} workers but the GPU pool has {pool.size} GPUs "
            f"(trainer.n_gpus_per_node={pool.n_gpus_per_node} x trainer.nnodes={pool.nnodes}), and rank i of "
            "every role runs on GPU i; lower the role's num_workers or add GPUs."
        )
    return [
        RankPlacement(GPU_SHARE, pool, i // pool.n_gpus_per_node, i % pool.n_gpus_per_node) for i in range(num_workers)
    ]


def node_placement_group(pool: GpuPool, node: int, timeout_s: float = PG_READY_TIMEOUT_S):
    """The detached STRICT_PACK placement group of pool node `node` (n_gpus_per_node bundles {"GPU": 1}),
    found by name or created, waited for at most `timeout_s`; a cluster with too few GPUs is an error saying so."""
    name = pool.node_group_name(node)
    try:
        return ray.util.get_placement_group(name)
    except ValueError:  # none of that name yet
        pass
    have = ray.cluster_resources().get("GPU", 0)
    if have < pool.size:
        raise RuntimeError(
            f"the run asks for {pool.size} GPUs (trainer.n_gpus_per_node={pool.n_gpus_per_node} x "
            f"trainer.nnodes={pool.nnodes}) but the Ray cluster has {have:g}; set trainer.n_gpus_per_node=0 "
            "for a CPU run, or attach to a cluster with enough GPUs (ray.address)."
        )
    bundles = [{"GPU": 1.0}] * pool.n_gpus_per_node
    pg = ray.util.placement_group(bundles, strategy="STRICT_PACK", name=name, lifetime="detached")
    return wait_placed(
        pg,
        f"{name} (STRICT_PACK: all on one node; lower trainer.n_gpus_per_node to the GPUs of one node or free them)",
        bundles,
        timeout_s,
    )


def role_placement_group(name: str, bundles: list[dict[str, float]], timeout_s: float = PG_READY_TIMEOUT_S):
    """The detached PACK placement group `name` with `bundles` (one per rank), found by name when it has exactly
    those bundles, else (re)made; waited for at most `timeout_s` (ray.placement_timeout_s). A group whose bundles
    were on a lost node (Ray reschedules them) waits for remaining or new capacity just as long; a cluster that
    cannot hold them in time is a PlacementTimeoutError saying so, never a silent wait."""
    try:
        pg = ray.util.get_placement_group(name)
    except ValueError:  # none of that name yet
        pg = None
    if pg is not None:
        table = ray.util.placement_group_table(pg)
        have = [table["bundles"][i] for i in sorted(table["bundles"])]
        if have == bundles and table["strategy"] == "PACK" and table["state"] != "REMOVED":
            if table["state"] != "CREATED":
                log.warning(
                    "placement group %s is %s (a node holding its bundles was lost): waiting up to %g s "
                    "for Ray to place it again",
                    name,
                    table["state"],
                    timeout_s,
                )
            return wait_placed(pg, name, bundles, timeout_s)
        ray.util.remove_placement_group(pg)  # the role's size or resources changed: its workers are rebuilt
    pg = ray.util.placement_group(bundles, strategy="PACK", name=name, lifetime="detached")
    return wait_placed(pg, name, bundles, timeout_s)


def wait_placed(pg, name: str, bundles: list[dict[str, float]], timeout_s: float):
    """`pg` once Ray placed all its bundles; after `timeout_s` the group is removed (its workers are rebuilt
    from scratch on a retry) and a PlacementTimeoutError says what was missing and how to fix it."""
    if pg.wait(timeout_seconds=timeout_s):
        return pg
    ray.util.remove_placement_group(pg)
    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    free = ray.available_resources()
    have = {key: free.get(key, 0.0) for key in bundles[0]}
    raise PlacementTimeoutError(
        f"placement group {name} ({len(bundles)} bundles of {bundles[0]}) was not placed within {timeout_s:g} s "
        f"(ray.placement_timeout_s): the Ray cluster's {alive} live nodes have {have} free in all, e.g. after "
        "losing a node. Add nodes with those resources, or lower that role's num_workers or its "
        "ray.resources_per_worker; `rlake train` retries the iteration (trainer.max_iteration_retries)."
    )


def _bundle_options(bundle: Mapping[str, float]) -> dict[str, Any]:
    """Actor options requesting a whole bundle (CPU, GPU, memory as options; custom resources by name)."""
    opts: dict[str, Any] = {"num_cpus": 0}
    custom = {}
    for key, count in bundle.items():
        if key in RAY_KEYS:
            opts[RAY_KEYS[key]] = count
        else:
            custom[key] = count
    return {**opts, "resources": custom} if custom else opts


def actor_options(placement: RankPlacement, timeout_s: float = PG_READY_TIMEOUT_S) -> dict[str, Any]:
    """Ray actor .options() for a rank: its own role's bundle (ray.resources_per_worker; the group exists, made
    by role_placement_group), or on GPUs num_gpus and its GPU-pool bundle (placed within `timeout_s`); {} on a
    CPU run."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415 - placed runs only

    if placement.group is not None:
        strategy = PlacementGroupSchedulingStrategy(
            ray.util.get_placement_group(placement.group), placement_group_bundle_index=placement.bundle_index
        )
        return {**_bundle_options(dict(placement.resources)), "scheduling_strategy": strategy}
    if placement.pool is None:
        return {}
    pg = node_placement_group(placement.pool, placement.node, timeout_s)
    return {
        "num_gpus": placement.num_gpus,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=placement.bundle_index
        ),
    }


def remove_placement_groups(*prefixes: str) -> list[str]:
    """Remove the placement groups of this namespace whose name starts with one of `prefixes` (the GPU pool's
    PG_PREFIX, a run's `rlake:<run>:`); returns their names. Groups of other namespaces are left alone."""
    names = {
        info.get("name") or "" for info in ray.util.placement_group_table().values() if info.get("state") != "REMOVED"
    }
    removed = []
    for name in sorted(n for n in names if n and n.startswith(prefixes)):
        try:
            ray.util.remove_placement_group(ray.util.get_placement_group(name))
            removed.append(name)
        except Exception:  # another namespace's group of that name, or removed meanwhile
            pass
    return removed


def remove_pool_placement_groups() -> list[str]:
    """Remove every rlake GPU-pool placement group of this namespace; returns their names."""
    return remove_placement_groups(PG_PREFIX)


_BUNDLE = re.compile(r"bundle_group_(\d+)_([0-9a-f]+)")
"""Ray's name of bundle i of placement group <id> in a worker's resource assignment (any bundle, GPU or not)."""


def assigned_bundle() -> tuple[str, int] | None:
    """(placement group id, bundle index) of this Ray actor's bundle, read from the resources Ray assigned it
    (`bundle_group_<index>_<pg id>`, the names Ray's get_assigned_resources folds away); None outside a bundle."""
    ids = ray.get_runtime_context().worker.core_worker.resource_ids()
    found = [m for m in map(_BUNDLE.fullmatch, ids) if m]
    return (found[0].group(2), int(found[0].group(1))) if found else None


def assigned_gpu_ids() -> list:
    """The GPU ids Ray assigned to this process when it is a Ray actor; [] elsewhere (a driver, a test)."""
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return []
    return list(ray.get_gpu_ids())


def resolve_device(gpu_ids: list, cuda_available: bool) -> torch.device:
    """cuda:0 when Ray assigned this process a GPU and CUDA is usable (Ray's CUDA_VISIBLE_DEVICES makes the
    assigned GPU device 0), else the CPU (a CPU run, or fake GPUs on a machine without CUDA)."""
    return torch.device("cuda", 0) if gpu_ids and cuda_available else torch.device("cpu")


def worker_device() -> torch.device:
    """This process's device: resolve_device of Ray's assignment and torch.cuda.is_available()."""
    return resolve_device(assigned_gpu_ids(), torch.cuda.is_available())


def collective_backend(device: torch.device) -> str:
    """torch.distributed backend for ranks on `device`: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"
