"""WorkerGroup: the run's long-lived Ray actors of one role, called by bound method.

verl keeps its worker groups alive for the whole run, and so does rlake: starting a trainer group
or loading an engine costs seconds, so a role's actors are created once and found again by name
(`rlake:<run>:<role>:<build>:<rank>`) by every later stage of the run. There is no module-level registry:
Ray's named actors are the registry. They are detached (a named actor that is not would be
garbage-collected as soon as the stage that built it drops its WorkerGroup). On the local default the
driver process exit kills them (`shutdown_worker_groups`, registered at exit once a group is built; the
local cluster goes with the process anyway). On a cluster (ray.address) they outlive the process, so a
run's per-iteration processes (runs launched from the UI) find them in the run's namespace: the run's end
removes them (`gc_run`), and `rlake gc --run-id R` does after a crash.

    group = worker_group(ActorWorker, "actor", num_workers=2, threads=1, process_group=True)
    metrics = group.call(ActorWorker.update, request)          # one result per rank
    parts = group.call_each(RolloutWorker.generate, shards)     # rank i gets shards[i]

A worker class is a plain Python class deriving from `Worker` (state in attributes; unit tests use it
without Ray); the group makes it a Ray actor. Fault handling: when a rank raises, the whole group is
killed at once (a surviving rank would otherwise block in a collective) and the error raised; when an
actor died (killed process, OOM), `call_with_retry` rebuilds the group and retries.

Placement (stages/workers/placement.py): a role named in ray.resources_per_worker gets one PACK placement
group of num_workers bundles, rank i in bundle i, and torch threads = the bundle's CPUs. Other roles reserve
no Ray CPUs (the stages run one at a time and each worker sets its own thread count). On a GPU run
(trainer.n_gpus_per_node > 0) each rank of an unnamed role requests its share of a GPU in the pool's
placement group, works on `self.device` (cuda:0, the GPU Ray assigned; the CPU without CUDA) and the
process group is NCCL instead of gloo. The process group's rendezvous is a FileStore on the local default
(a TCPStore listens on every interface) and a TCPStore on rank 0's node IP on a cluster.

Connecting (ray.address, token auth, loopback binding, ray.runtime_env) is stages/workers/connect.py;
`ensure_ray` is imported from here too.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import ray
import torch
import torch.distributed as dist
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from stages.workers import rendezvous, shard_io
from stages.workers.connect import ensure_ray, ensure_ray_for, settings
from stages.workers.placement import (
    CPU_ONLY,
    PG_PREFIX,
    GpuPool,
    actor_options,
    assigned_bundle,
    bundle_threads,
    collective_backend,
    rank_placements,
    remove_placement_groups,
    role_group_name,
    role_placement_group,
    worker_device,
)

__all__ = [
    "NAME_PREFIX",
    "Worker",
    "WorkerGroup",
    "call_with_retry",
    "ensure_ray",
    "ensure_ray_for",
    "existing_workers",
    "gc_run",
    "worker_group",
    "worker_placements",
]

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
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "threads": self.threads,
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
        """This node's IP and a port listening on it only, held for init_process_group: rank 0's TCPStore
        address on a cluster (stages/workers/rendezvous.py)."""
        ip = ray.util.get_node_ip_address()
        self.store_listener = rendezvous.listener(ip)
        return ip, self.store_listener.getsockname()[1]

    def init_process_group(self, init_method: str) -> None:
        """Join the group's gloo/NCCL process group at `init_method` (file://... or tcp://host:port)."""
        kw: dict[str, Any] = {"rank": self.rank, "world_size": self.world, "timeout": timedelta(minutes=30)}
        if init_method.startswith("tcp://"):  # bound to the node IP, never every interface
            rendezvous.pin_interfaces(ray.util.get_node_ip_address())
            listening, self.store_listener = getattr(self, "store_listener", None), None
            kw["store"] = rendezvous.tcp_store(init_method, self.rank, self.world, listening, kw["timeout"])
        else:
            kw["init_method"] = init_method
        dist.init_process_group(collective_backend(self.device), **kw)

    def pid(self) -> int:
        return os.getpid()

    def run_shard(
        self,
        method: str,
        args: tuple,
        source,
        sink: shard_io.Sink | None,
        finish: shard_io.Finish | None,
        prepare: shard_io.Prepare | None = None,
    ) -> shard_io.ShardResult:
        """This rank's part of a sharded stage (stages/workers/sharded.py): read `source` (its slice of a Delta
        partition, or rows sent along; `prepare`d), call self.<method>(*args) with them in place of SHARD, and write the
        output through `sink` from here (stages/workers/shard_io.py)."""
        return shard_io.run_shard(self, method, args, source, sink, finish, prepare)


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


def _role_prefix(role: str, run_id: str | None = None) -> str:
    return f"{NAME_PREFIX}{run_id or settings().run_id}:{role}:"


def _find(role: str, run_id: str | None = None) -> list:
    """The named actors of `role` of run `run_id` (default: this process's run), `rlake:<run>:<role>:<build>:
    <rank>`, in rank order; an empty list when none. Each build gets a fresh `<build>` nonce, so a rebuilt
    group never waits for a dead actor's name."""
    prefix = _role_prefix(role, run_id)
    names = _named(prefix)
    builds = {n[len(prefix) :].split(":")[0] for n in names}
    if len(builds) != 1:
        for n in names:  # leftovers of an interrupted rebuild: start clean
            _kill_named(n)
        return []
    ranks = sorted(int(n.rsplit(":", 1)[1]) for n in names)
    if ranks != list(range(len(ranks))):
        return []
    build = builds.pop()
    return [ray.get_actor(f"{prefix}{build}:{r}") for r in ranks]


def existing_workers(role: str) -> list:
    """The live actors of `role` of this process's run, in rank order, without building any ([] when none)."""
    return _find(role) if ray.is_initialized() else []


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
    backend: str = "worker_group",
    max_failures: int = 2,
    **init_kwargs: Any,
) -> WorkerGroup:
    """The run's group of `role`, created on first use and rebuilt when its shape changed.

    init_kwargs go to worker_cls(rank, world, threads, shape, **init_kwargs); with process_group the
    ranks join one gloo (NCCL on GPUs) group (rank i = actor i). gpus: the run's GPU pool
    (GpuPool.of(cfg.trainer)); rank i requests its share of GPU i (stages.workers.placement). A role named in
    ray.resources_per_worker (recorded by ensure_ray) is placed in its own placement group instead, each rank
    with the bundle's CPUs as `threads`. backend 'ray_train': the ranks are one Ray Train run that restarts
    itself up to max_failures times (stages/workers/train_group.py; no GPU pool)."""
    run = settings()
    resources = run.resources_per_worker.get(role)
    group_name = role_group_name(run.run_id, role)
    placements = rank_placements(gpus, role, num_workers, resources=resources, group=group_name)
    threads = bundle_threads(resources, threads) if resources else threads
    shape = repr((worker_cls.__module__, worker_cls.__qualname__, num_workers, threads, process_group))
    shape += repr((sorted(init_kwargs.items()), gpus, sorted((resources or {}).items())))
    if backend == "ray_train":
        from stages.workers.train_group import train_group  # noqa: PLC0415 - it imports this module

        shape += repr((backend, max_failures))
        spec = {"num_workers": num_workers, "threads": threads, "process_group": process_group, "shape": shape}
        spec |= {"resources": resources, "init_kwargs": init_kwargs, "max_failures": max_failures, "local": run.local}
        return train_group(worker_cls, role, spec)
    found = _existing(worker_cls, role, num_workers, shape)
    if found is not None:
        return found
    if resources:
        role_placement_group(group_name, [dict(p.resources) for p in placements], run.placement_timeout_s)
    build = uuid.uuid4().hex[:8]
    handles = _start_actors(worker_cls, role, build, placements, threads, shape, init_kwargs)
    group = WorkerGroup(worker_cls, role, handles)
    if process_group and num_workers > 1:
        group.call(Worker.init_process_group, _rendezvous(handles[0], f"{role}-{build}"))
    return group


def _start_actors(
    worker_cls: type, role: str, build: str, placements: list, threads: int, shape: str, init_kwargs: dict
) -> list:
    """The detached, named actors `rlake:<run>:<role>:<build>:<rank>` of a new group, rank i at placements[i]."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}  # merged into the job's env_vars
    remote = ray.remote(num_cpus=0, max_restarts=0, runtime_env={"env_vars": env})(worker_cls)
    _kill_groups_at_exit()
    prefix, timeout_s = _role_prefix(role), settings().placement_timeout_s
    return [
        remote.options(name=f"{prefix}{build}:{i}", lifetime="detached", **actor_options(p, timeout_s)).remote(
            i, len(placements), threads, shape, **init_kwargs
        )
        for i, p in enumerate(placements)
    ]


def _existing(worker_cls: type, role: str, num_workers: int, shape: str) -> WorkerGroup | None:
    """The run's live group of `role` when it has `shape`; else None, any other group of the role killed
    (one group per role: a new shape replaces the old)."""
    handles = _find(role)
    if not handles:
        return None
    try:
        if len(handles) == num_workers and ray.get([h.shape.remote() for h in handles]) == [shape] * num_workers:
            return WorkerGroup(worker_cls, role, handles)
    except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
        log.warning("%s worker group lost an actor (%s); building it again", role, " ".join(str(exc).split())[:300])
    WorkerGroup(worker_cls, role, handles).kill()
    return None


def _rendezvous(rank0, key: str) -> str:
    """The process group's init_method: a FileStore on the local default (all ranks on this machine, and no
    socket opened: torch's TCPStore listens on every interface whatever host it is given), else a TCPStore
    listening on rank 0's node IP only (stages/workers/rendezvous.py)."""
    if settings().local:
        return f"file://{_store_dir() / key}"
    host, port = ray.get(rank0.free_address.remote())
    return f"tcp://{host}:{port}"


@functools.cache
def _store_dir() -> Path:
    """This driver's directory of FileStore files, removed at its exit (a killed group never deletes its own
    file: torch removes it only when every rank destroys its process group)."""
    path = Path(tempfile.mkdtemp(prefix="rlake-pgstore-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def call_with_retry(make_group: Callable[[], WorkerGroup], fn: Callable[[WorkerGroup], R], *, retries: int = 1) -> R:
    """fn(make_group()); if an actor died (not a Python error in the task), rebuild the group and retry,
    up to `retries` times, then raise the last error."""
    for attempt in range(retries + 1):
        group = make_group()
        try:
            return fn(group)
        except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
            if not getattr(exc, "restarts_itself", False):  # a Ray Train group restarts itself (train_group.py)
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


def shutdown_worker_groups() -> None:
    """Kill every rlake worker of this Ray namespace (the local cluster's, or this run's on a cluster) and
    remove its rlake placement groups (the GPU pool's and the roles')."""
    if not ray.is_initialized():  # at exit after ray.shutdown(): a local cluster took its actors along
        return
    for name in _named(NAME_PREFIX):
        _kill_named(name)
    remove_placement_groups(PG_PREFIX, NAME_PREFIX)


def worker_placements(run_id: str | None = None, *, timeout_s: float = 30.0) -> list[dict]:
    """One row per live named worker of run `run_id` (default: this process's run): role, rank, actor name and
    Worker.placement() (Ray node id and IP, pid, threads, device, resources, bundle), in role/rank order. A
    worker that does not answer (its node died) is left out: the rows say where the run's work can go now."""
    prefix = f"{NAME_PREFIX}{run_id or settings().run_id}:"
    rows = []
    for name in sorted(_named(prefix)):
        role, _build, rank = name[len(prefix) :].rsplit(":", 2)
        try:
            where = ray.get(ray.get_actor(name).placement.remote(), timeout=timeout_s)
        except (ValueError, ray.exceptions.RayError):
            continue
        where["resources"] = json.dumps(where.get("resources") or {}, sort_keys=True)
        rows.append({"role": role, "rank": int(rank), "actor_name": name, **where})
    return sorted(rows, key=lambda r: (r["role"], r["rank"]))


def gc_run(run_id: str) -> dict[str, list[str]]:
    """Kill run `run_id`'s named workers (`rlake:<run>:...`) and remove its placement groups: the roles'
    (`rlake:<run>:<role>`) and, in the run's own namespace (a cluster), the GPU pool's. What the end of a run
    and `rlake gc --run-id R` (after a crash) call. Returns {"actors": [...], "placement_groups": [...]}."""
    if not ray.is_initialized():
        raise RuntimeError(
            f"gc_run({run_id!r}) needs a Ray connection: connect to the run's cluster first (ensure_ray with the "
            "run's ray.address and run_id), because the run's workers live there."
        )
    prefix = f"{NAME_PREFIX}{run_id}:"
    actors = _named(prefix)
    for name in actors:
        _kill_named(name)
    own_namespace = ray.get_runtime_context().namespace.endswith(f":{run_id}")
    groups = remove_placement_groups(*((prefix, PG_PREFIX) if own_namespace else (prefix,)))
    return {"actors": actors, "placement_groups": groups}


def _at_exit() -> None:
    """At the driver's exit: on the local default, kill the workers (shutdown_worker_groups); on a cluster
    keep them for the run's next process (gc_run at the run's end, `rlake gc` after a crash)."""
    if settings().local:
        shutdown_worker_groups()


@functools.cache
def _kill_groups_at_exit() -> None:
    """Register _at_exit once, after ray.init registered its own shutdown (exit handlers run
    last-registered first, so the workers are killed while Ray is still connected)."""
    atexit.register(_at_exit)
