"""The policy_checkpoint stage: one PPO update of policy version N into version N+1.

Flow: assets/policy_checkpoint.py `materialize` -> `update_request` (the one builder of an UpdateRequest
from the run config; `rlake replay` uses it too) -> `run_update`, which calls `ActorWorker.update`
(stages/workers/actor_worker.py) on every rank of the run's "actor" group: actor.num_workers Ray actors
in one gloo process group, kept for the whole run. Rank 0 commits the new checkpoint (out_dir: a
stages.io.checkpoints.checkpoint_target, or a local directory); the update's metrics come back as the call's
value through Ray (the policy_checkpoint asset records them in the `checkpoints` table row of the commit).
"""

from __future__ import annotations

import time
from pathlib import Path

import ray

from configs.schema import ActorConfig, RunConfig
from stages import seeds
from stages.train.batching import logprob_temperature
from stages.workers.actor_worker import ActorWorker
from stages.workers.group import WorkerGroup, call_with_retry, worker_group
from stages.workers.placement import CPU_ONLY, GpuPool
from stages.workers.requests import UpdateRequest


def update_request(
    cfg: RunConfig,
    iteration: int,
    *,
    advantages_uri: str,
    advantages_version: int,
    policy_dir: str | Path,
    out_dir: str | Path,
    extra_files: dict[str, str] | None = None,
) -> UpdateRequest:
    """Iteration `iteration`'s policy update: advantages at the recorded version, policy_dir -> out_dir (each a
    checkpoint reference / target or a local directory); extra_files are committed with the new checkpoint."""
    return UpdateRequest(
        run_id=cfg.run_id,
        iteration=iteration,
        advantages_uri=advantages_uri,
        advantages_version=int(advantages_version),
        policy_dir=str(policy_dir),
        out_dir=str(out_dir),
        actor=cfg.trainer_role(cfg.actor),
        n_per_prompt=cfg.rollout.n,
        seed=seeds.update(cfg.seed, iteration),
        temperature=logprob_temperature(cfg.rollout.temperature),
        checkpoint_id=f"{cfg.run_id}/{iteration}/{time.time_ns()}",
        gpus=GpuPool.of(cfg.trainer),
        rollout_correction=cfg.algorithm.rollout_correction,
        weight_sync=cfg.rollout.weight_sync,
        extra_files=tuple(sorted((extra_files or {}).items())),
    )


def actor_group(req: UpdateRequest) -> WorkerGroup:
    """The run's "actor" group for this request (rebuilt when the worker count, threads or strategy change)."""
    return actor_workers(req.actor, req.threads_per_worker, req.gpus)


def actor_workers(actor: ActorConfig, threads_per_worker: int | None = None, gpus: GpuPool = CPU_ONLY) -> WorkerGroup:
    """The run's "actor" group for actor.num_workers and actor.strategy: the update's and, before it, the
    old_logprobs stage's (stages/old_logprobs.py), so both find the same processes and resident policy (both
    must pass the same gpus, the run's GPU pool, or the group is rebuilt).
    threads_per_worker None: the ranks share one node's CPUs (1 rank on 2 cores gets 2, 2 ranks 1 each); on a
    cluster the smallest node's, since unplaced ranks may all land on one node (a role named in
    ray.resources_per_worker gets its bundle's CPUs instead, stages/workers/group.py)."""
    n = actor.num_workers
    threads = threads_per_worker or max(1, node_cpus() // n)
    return worker_group(
        ActorWorker,
        "actor",
        n,
        threads=threads,
        process_group=True,
        gpus=gpus,
        backend=actor.worker_backend,
        max_failures=actor.ray_train_max_failures,
        strategy=actor.strategy,
    )


def node_cpus() -> int:
    """CPUs of the smallest alive Ray node that has any (the whole machine on the local default)."""
    cpus = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    return min((c for c in cpus if c > 0), default=1)


def run_update(req: UpdateRequest) -> dict[str, float]:
    """Run the update on the actor group (rebuilt and retried once when an actor died); returns rank 0's
    metrics, returned through Ray, plus timing_s/update, the wall time of the whole call."""
    t0 = time.perf_counter()
    results = call_with_retry(lambda: actor_group(req), lambda g: g.call(ActorWorker.update, req))
    metrics = dict(results[0])
    metrics["timing_s/update"] = time.perf_counter() - t0
    return metrics
