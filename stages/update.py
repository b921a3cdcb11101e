"""Policy-update stage: PPO epochs on a persistent gloo worker group (stages.workers.group).

Each worker reads the iteration's rows from the advantages Delta table at the recorded version,
takes its contiguous share of every mini-batch, runs `stages.train.actor.ppo_update` under DDP, and
rank 0 writes the new HF checkpoint (plus optimizer state and metrics) into the model store.

The workers live for the whole run and keep the policy and optimizer they just wrote resident:
the next update skips the load when its input checkpoint is the one they wrote (same directory,
same CHECKPOINT_ID), and loads from disk otherwise (a re-materialized or replayed iteration, a
resumed run). Either way the update is the same function of the checkpoint on disk.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from stages import seeds

OPTIMIZER_FILE = "optimizer.pt"
METRICS_FILE = "update_metrics.json"
CHECKPOINT_ID = "checkpoint_id.txt"
TRAIN_LOOPS = {"torch": "stages.update:train_loop_per_worker", "megatron": "stages.train.megatron:train_loop_per_worker"}

_RESIDENT: dict = {}
"""In a persistent worker: {"dir", "id", "optim", "model", "opt", "sched", "tok"} of the last checkpoint written."""


def shard_for_rank(n: int, mini: int, rank: int, world: int) -> list[int]:
    """Indices of this rank's rows: the rank-th contiguous slice of every mini-batch of `mini` rows."""
    per = mini // world
    return [m + rank * per + j for m in range(0, n, mini) for j in range(per)]


def _worker_rows(job: dict, rank: int, world: int) -> dict:
    from stages.io.store import read_partition

    df = read_partition(job["advantages_uri"], job["run_id"], job["iteration"], version=job["advantages_version"])
    df = df.sort_values("rollout_id").reset_index(drop=True)
    mini = job["ppo_mini_batch_size"] * job["n_per_prompt"]
    idx = shard_for_rank(len(df), mini, rank, world)
    part = df.iloc[idx]
    rows = {"prompt_token_ids": [list(x) for x in part["prompt_token_ids"]],
            "response_token_ids": [list(x) for x in part["response_token_ids"]],
            "advantages": torch.tensor(part["advantage"].to_numpy(), dtype=torch.float32)}
    if "token_advantages" in part.columns:
        rows["token_advantages"] = [list(x) for x in part["token_advantages"]]
    if "ref_logprobs" in part.columns:
        rows["ref_logprobs"] = [list(x) for x in part["ref_logprobs"]]
    return rows


def checkpoint_id(policy_dir: str | Path) -> str | None:
    path = Path(policy_dir) / CHECKPOINT_ID
    return path.read_text().strip() if path.is_file() else None


def _load_state(job: dict, actor_cfg):
    """(model, optimizer, scheduler, tokenizer, loaded_from_disk) for job["policy_dir"]."""
    from stages.models.policy import load_policy
    from stages.train.actor import make_optimizer

    res, want = _RESIDENT, checkpoint_id(job["policy_dir"])
    if (res.get("dir") == str(Path(job["policy_dir"]).resolve()) and want is not None and res.get("id") == want
            and res.get("optim") == actor_cfg.optim):
        return res["model"], res["opt"], res["sched"], res["tok"], False
    _RESIDENT.clear()
    model, tok = load_policy(job["policy_dir"])
    opt, sched = make_optimizer(model, actor_cfg.optim)
    opt_path = Path(job["policy_dir"]) / OPTIMIZER_FILE
    if opt_path.is_file():
        state = torch.load(opt_path, weights_only=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
    return model, opt, sched, tok, True


def write_checkpoint(out_dir: str | Path, model, tok, opt_state: dict, sched_state: dict, metrics: dict,
                     ckpt_id: str | None) -> None:
    """HF model + optimizer state + metrics (+ id), atomically: the directory is complete or absent."""
    from stages.models.policy import save_policy

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    save_policy(model, tok, tmp)
    torch.save({"optimizer": opt_state, "scheduler": sched_state}, tmp / OPTIMIZER_FILE)
    (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=1, sort_keys=True))
    if ckpt_id:
        (tmp / CHECKPOINT_ID).write_text(ckpt_id)
    if out.exists():  # a retried attempt replaces its own earlier output
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)


def train_loop_per_worker(job: dict) -> dict[str, float]:
    """One PPO update on this rank (world size 1 without a process group); returns rank's metrics."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from configs.schema import ActorConfig
    from stages.train.actor import ppo_update

    torch.set_num_threads(job.get("threads_per_worker", 1))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    actor_cfg = ActorConfig.model_validate(job["actor"])
    torch.manual_seed(seeds.update_rank(job["seed"], rank))
    t0 = time.perf_counter()
    model, opt, sched, tok, from_disk = _load_state(job, actor_cfg)
    ddp = DistributedDataParallel(model) if world > 1 else None
    rows = _worker_rows(job, rank, world)
    t_load = time.perf_counter() - t0
    metrics = ppo_update(model, opt, sched, rows, actor_cfg, n_per_prompt=job["n_per_prompt"],
                         pad_id=tok.pad_token_id, seed=job["seed"], ddp_model=ddp,
                         temperature=job.get("temperature", 1.0))
    metrics["timing_s/update_load"] = t_load
    metrics["timing_s/update_compute"] = time.perf_counter() - t0 - t_load
    metrics["actor/weights_loaded_from_disk"] = float(from_disk)
    new_id = job.get("checkpoint_id") or f"{job['run_id']}/{job['iteration']}/{time.time_ns()}"
    if rank == 0:
        write_checkpoint(job["out_dir"], model, tok, opt.state_dict(), sched.state_dict(), metrics, new_id)
    if world > 1:
        dist.barrier()  # every rank sees the checkpoint before keeping its state resident
    _RESIDENT.update(dir=str(Path(job["out_dir"]).resolve()), id=new_id, optim=actor_cfg.optim, model=model,
                     opt=opt, sched=sched, tok=tok)
    return metrics


def run_policy_update(job: dict, *, num_workers: int) -> dict[str, float]:
    """Run one update on the persistent worker group; returns the metrics rank 0 wrote next to the
    checkpoint (plus timing_s/update, the wall time of the whole call)."""
    import ray

    from stages.workers.group import run_with_retry

    t0 = time.perf_counter()
    # the ranks share the node's CPUs: 1 rank on 2 cores gets 2 threads, 2 ranks get 1 each
    threads = job.get("threads_per_worker") or max(1, int(ray.cluster_resources().get("CPU", 1)) // num_workers)
    job = {**job, "checkpoint_id": f"{job['run_id']}/{job['iteration']}/{time.time_ns()}", "threads_per_worker": threads}
    strategy = job["actor"].get("strategy", "torch")
    run_with_retry(f"trainer-{strategy}", num_workers, lambda g: g.run(TRAIN_LOOPS[strategy], job),
                   threads=threads)
    path = Path(job["out_dir"]) / METRICS_FILE
    metrics = json.loads(path.read_text())
    metrics["timing_s/update"] = time.perf_counter() - t0
    path.write_text(json.dumps(metrics, indent=1, sort_keys=True))
    return metrics
