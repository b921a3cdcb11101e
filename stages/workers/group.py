"""Long-lived Ray actors that outlive one iteration: the trainer's gloo worker group and the rollout
engine hosts.

Starting a Ray Train run (or a Ray Data actor pool holding an inference engine) costs seconds per
iteration; verl keeps its worker groups alive for the whole run, and so does rlake. Actors are owned
by the driver process (they die with it) and are cached per Ray session, keyed by their shape:

    group = worker_group("trainer", num_workers=2, threads=1)
    results = group.run("stages.update:train_loop_per_worker", job)   # one result per rank

Fault handling: when any rank fails, the whole group is killed at once (a surviving rank would
otherwise block in a collective) and the error is raised; when an actor died (killed process,
OOM), the group is rebuilt and the call retried once. Actors reserve no Ray CPUs: they run one stage
at a time, interleaved with the Ray Data stages, and set their own thread counts.
"""
from __future__ import annotations

import importlib
import logging
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

_GROUPS: dict[str, WorkerGroup] = {}


def resolve(qualname: str) -> Callable:
    """'package.module:function' -> the function."""
    module, _, name = qualname.partition(":")
    return getattr(importlib.import_module(module), name)


class _Worker:
    """One rank. `run` calls a function by qualified name in this long-lived process; the function
    may keep state in its module (the torch backend keeps the policy and optimizer resident)."""

    def __init__(self, rank: int, world: int, threads: int) -> None:
        import torch

        self.rank, self.world = rank, world
        torch.set_num_threads(threads)

    def free_address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def init_process_group(self, host: str, port: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(minutes=30))

    def call(self, qualname: str, *args: Any) -> Any:
        return resolve(qualname)(*args)

    def pid(self) -> int:
        return os.getpid()


class WorkerGroup:
    """`num_workers` actors of `worker_cls(rank, world, threads)` (a `_Worker` subclass); with
    `process_group`, joined in one gloo group (rank i = actor i)."""

    def __init__(self, num_workers: int, *, threads: int = 1, process_group: bool = True,
                 worker_cls: type = _Worker) -> None:
        import ray

        self.num_workers, self.threads, self.process_group = num_workers, threads, process_group
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        remote = ray.remote(num_cpus=0, max_restarts=0, runtime_env={"env_vars": env})(worker_cls)
        self.workers = [remote.remote(i, num_workers, threads) for i in range(num_workers)]
        if process_group and num_workers > 1:
            host, port = ray.get(self.workers[0].free_address.remote())
            ray.get([w.init_process_group.remote(host, port) for w in self.workers])

    def run(self, qualname: str, *args: Any) -> list[Any]:
        """Call the function on every rank with the same arguments; results in rank order."""
        return self.map("call", [(qualname, *args)] * self.num_workers)

    def map(self, method: str, per_worker_args: list[tuple]) -> list[Any]:
        """Call `method` on worker i with per_worker_args[i] (fewer args -> fewer workers)."""
        import ray

        refs = [getattr(w, method).remote(*a) for w, a in zip(self.workers, per_worker_args)]
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
        import ray

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead, or a handle of an earlier Ray session
                pass
        self.workers = []

    @property
    def alive(self) -> bool:
        return bool(self.workers)


def _session() -> str:
    """The Ray session: job ids restart at 01000000 in every new local cluster, node ids do not."""
    import ray

    ctx = ray.get_runtime_context()
    return f"{ctx.get_node_id()}/{ctx.get_job_id()}"


def worker_group(kind: str, num_workers: int, *, threads: int = 1, **kwargs: Any) -> WorkerGroup:
    """The cached group of this kind, rebuilt when its shape or the Ray session changed."""
    key = repr((_session(), num_workers, threads, sorted(kwargs.items(), key=lambda kv: kv[0])))
    group = _GROUPS.get(kind)
    if group is not None and group.alive and getattr(group, "key", None) == key:
        return group
    if group is not None and group.alive:
        group.kill()  # one group per kind: a new shape replaces the old one
    group = WorkerGroup(num_workers, threads=threads, **kwargs)
    group.key = key  # type: ignore[attr-defined]
    _GROUPS[kind] = group
    return group


def run_with_retry(kind: str, num_workers: int, fn: Callable[[WorkerGroup], Any], *, threads: int = 1,
                   retries: int = 1, **kwargs: Any) -> Any:
    """fn(group); if an actor died (not a Python error in the task), rebuild the group and retry,
    up to `retries` times, then raise the last error."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    for attempt in range(retries + 1):
        group = worker_group(kind, num_workers, threads=threads, **kwargs)
        try:
            return fn(group)
        except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
            group.kill()
            if attempt == retries:
                raise
            log.warning("%s worker group lost an actor (%s); rebuilding it, retry %d of %d", kind, exc,
                        attempt + 1, retries)


def shutdown_worker_groups() -> None:
    """Kill every cached group (the driver exiting does the same)."""
    for group in _GROUPS.values():
        if group.alive:
            group.kill()
    _GROUPS.clear()
