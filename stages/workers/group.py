"""WorkerGroup: the run's long-lived Ray actors of one role, called by bound method.

verl keeps its worker groups alive for the whole run, and so does rlake: starting a trainer group
or loading an engine costs seconds, so a role's actors are created once and found again by name
(`rlake:<role>:<build>:<rank>`) by every later stage of the run. There is no module-level registry:
Ray's named actors are the registry. They are detached (a named actor that is not would be
garbage-collected as soon as the stage that built it drops its WorkerGroup) and killed when the
driver process exits (`shutdown_worker_groups`, registered at exit once a group is built).

    group = worker_group(ActorWorker, "actor", num_workers=2, threads=1, process_group=True)
    metrics = group.call(ActorWorker.update, request)          # one result per rank
    parts = group.call_each(RolloutWorker.generate, shards)     # rank i gets shards[i]

A worker class is a plain Python class deriving from `Worker` (state in attributes; unit tests use it
without Ray); the group makes it a Ray actor. Fault handling: when a rank raises, the whole group is
killed at once (a surviving rank would otherwise block in a collective) and the error raised; when an
actor died (killed process, OOM), `call_with_retry` rebuilds the group and retries. Actors reserve no
Ray CPUs: the stages run one at a time and each worker sets its own thread count. On a GPU run
(trainer.n_gpus_per_node > 0) each rank requests its share of a GPU in the pool's placement group
(stages/workers/placement.py), works on `self.device` (cuda:0, the GPU Ray assigned; the CPU without
CUDA) and the process group is NCCL instead of gloo.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import ray
import torch
import torch.distributed as dist
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from stages.workers.placement import (
    CPU_ONLY,
    GpuPool,
    actor_options,
    assigned_bundle,
    collective_backend,
    rank_placements,
    remove_pool_placement_groups,
    worker_device,
)

log = logging.getLogger(__name__)
R = TypeVar("R")
NAME_PREFIX = "rlake:"


class Worker:
    """Base of every role's worker: rank, world size, torch threads and device (stages.workers.placement:
    cuda:0 when Ray assigned a GPU and CUDA is there, else cpu); joins a gloo/NCCL group on request."""

    def __init__(self, rank: int, world: int, threads: int, shape: str = "") -> None:
        self.rank, self.world, self.threads, self.shape_key = rank, world, threads, shape
        torch.set_num_threads(threads)
        self.device = worker_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def placement(self) -> dict:
        """What this rank got: Ray's assigned resources (GPU ids, placement-group bundle), its device and its
        process group's backend (None without one)."""
        bundle = assigned_bundle()
        return {
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "resources": ray.get_runtime_context().get_assigned_resources(),
            "placement_group": bundle[0] if bundle else None,
            "bundle_index": bundle[1] if bundle else None,
            "device": str(self.device),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "process_group": dist.get_backend() if dist.is_initialized() else None,
        }

    def shape(self) -> str:
        """What the group was built for (class, size, threads, options): a different shape rebuilds it."""
        return self.shape_key

    def free_address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def init_process_group(self, host: str, port: int) -> None:
        dist.init_process_group(
            collective_backend(self.device),
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(minutes=30),
        )

    def pid(self) -> int:
        return os.getpid()


def _method_name(worker_cls: type, method: Callable) -> str:
    """The name of `method` after checking it is a method of worker_cls (a typo fails here, not in Ray)."""
    name = getattr(method, "__name__", None)
    if name is None or getattr(worker_cls, name, None) is not method:
        raise TypeError(
            f"{method!r} is not a method of {worker_cls.__name__}; call the group with one, "
            f"e.g. {worker_cls.__name__}.{name or 'method'}"
        )
    return name


class WorkerGroup:
    """`handles[i]` is rank i, an actor of `worker_cls`. Build with `worker_group`."""

    def __init__(self, worker_cls: type, role: str, handles: list) -> None:
        self.worker_cls, self.role, self.handles = worker_cls, role, handles

    @property
    def num_workers(self) -> int:
        return len(self.handles)

    def call(self, method: Callable[..., R], *args: Any) -> list[R]:
        """method(*args) on every rank; results in rank order."""
        return self.call_each(method, [args] * self.num_workers)

    def call_each(self, method: Callable[..., R], per_rank_args: Sequence[tuple]) -> list[R]:
        """method(*per_rank_args[i]) on rank i (fewer argument tuples than ranks: the first ranks only)."""
        name = _method_name(self.worker_cls, method)
        refs = [getattr(h, name).remote(*a) for h, a in zip(self.handles, per_rank_args, strict=False)]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception:
                self.kill()  # peers of a failed rank would wait in a collective until timeout
                raise
        return ray.get(refs)

    def kill(self) -> None:
        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # already dead, or a handle of an earlier Ray session
                pass
        self.handles = []


def _named(prefix: str) -> list[str]:
    return [n for n in ray.util.list_named_actors() if n.startswith(prefix)]


def _find(role: str) -> list:
    """The named actors of `role` (`rlake:<role>:<build>:<rank>`), rank order; an empty list when none.
    Each build gets a fresh `<build>` nonce, so a rebuilt group never waits for a dead actor's name."""
    names = _named(f"{NAME_PREFIX}{role}:")
    builds = {n.split(":")[2] for n in names}
    if len(builds) != 1:
        for n in names:  # leftovers of an interrupted rebuild: start clean
            _kill_named(n)
        return []
    ranks = sorted(int(n.rsplit(":", 1)[1]) for n in names)
    if ranks != list(range(len(ranks))):
        return []
    build = builds.pop()
    return [ray.get_actor(f"{NAME_PREFIX}{role}:{build}:{r}") for r in ranks]


def _kill_named(name: str) -> None:
    try:
        ray.kill(ray.get_actor(name), no_restart=True)
    except Exception:  # died meanwhile
        pass


def engine_threads(num_workers: int) -> int:
    """torch threads of each worker of a num_workers group on the 2-core default: one worker gets 2, more 1 each."""
    return 2 if num_workers == 1 else 1


def worker_group(
    worker_cls: type,
    role: str,
    num_workers: int,
    *,
    threads: int = 1,
    process_group: bool = False,
    gpus: GpuPool = CPU_ONLY,
    **init_kwargs: Any,
) -> WorkerGroup:
    """The run's group of `role`, created on first use and rebuilt when its shape changed.

    init_kwargs go to worker_cls(rank, world, threads, shape, **init_kwargs); with process_group the
    ranks join one gloo (NCCL on GPUs) group (rank i = actor i). gpus: the run's GPU pool
    (GpuPool.of(cfg.trainer)); rank i requests its share of GPU i (stages.workers.placement)."""
    placements = rank_placements(gpus, role, num_workers)
    shape = repr(
        (
            worker_cls.__module__,
            worker_cls.__qualname__,
            num_workers,
            threads,
            process_group,
            sorted(init_kwargs.items()),
            gpus,
        )
    )
    handles = _find(role)
    if handles:
        try:
            if len(handles) == num_workers and ray.get([h.shape.remote() for h in handles]) == [shape] * num_workers:
                return WorkerGroup(worker_cls, role, handles)
        except (ActorDiedError, ActorUnavailableError, RayActorError):
            pass
        WorkerGroup(worker_cls, role, handles).kill()  # one group per role: a new shape replaces the old
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    remote = ray.remote(num_cpus=0, max_restarts=0, runtime_env={"env_vars": env})(worker_cls)
    build = uuid.uuid4().hex[:8]
    _kill_groups_at_exit()
    handles = [
        remote.options(name=f"{NAME_PREFIX}{role}:{build}:{i}", lifetime="detached", **actor_options(p)).remote(
            i, num_workers, threads, shape, **init_kwargs
        )
        for i, p in enumerate(placements)
    ]
    group = WorkerGroup(worker_cls, role, handles)
    if process_group and num_workers > 1:
        host, port = ray.get(handles[0].free_address.remote())
        group.call(Worker.init_process_group, host, port)
    return group


def call_with_retry(make_group: Callable[[], WorkerGroup], fn: Callable[[WorkerGroup], R], *, retries: int = 1) -> R:
    """fn(make_group()); if an actor died (not a Python error in the task), rebuild the group and retry,
    up to `retries` times, then raise the last error."""
    for attempt in range(retries + 1):
        group = make_group()
        try:
            return fn(group)
        except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
            group.kill()
            if attempt == retries:
                raise
            log.warning(
                "%s worker group lost an actor (%s); rebuilding it, retry %d of %d",
                group.role,
                exc,
                attempt + 1,
                retries,
            )
    raise AssertionError("unreachable")


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect this process to Ray once: the cluster at `address`, or a local one with num_cpus (None:
    all) when address is None (ray.address / ray.num_cpus of the run config). A no-op when connected."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_ACCEPT_CLOUD_SDK_WARNING", "1")
    # a local cluster is this process's own: its namespace may be fixed (detached worker actors in the
    # anonymous namespace make the raylet print a warning); on a shared cluster each driver keeps its own
    local = address in (None, "local")
    ray.init(
        address="local" if local else address,
        num_cpus=num_cpus if local else None,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        namespace="rlake" if local else None,
    )


def shutdown_worker_groups() -> None:
    """Kill every rlake worker of this Ray session (the driver exiting does the same) and remove the GPU
    pool's placement groups."""
    if not ray.is_initialized():  # at exit after ray.shutdown(): a local cluster took its actors along
        return
    for name in _named(NAME_PREFIX):
        _kill_named(name)
    remove_pool_placement_groups()


@functools.cache
def _kill_groups_at_exit() -> None:
    """Register shutdown_worker_groups at exit, once, after ray.init registered its own shutdown (exit
    handlers run last-registered first, so the workers are killed while Ray is still connected)."""
    atexit.register(shutdown_worker_groups)
