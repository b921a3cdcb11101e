"""Policy-update stage: PPO epochs in Ray Train workers (TorchTrainer, CPU, gloo).

Each worker reads the iteration's rows from the advantages Delta table at the recorded version,
takes its contiguous share of every mini-batch, runs `stages.trainer.ppo_update` under DDP, and
rank 0 writes the new HF checkpoint (plus optimizer state and metrics) into the model store.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

OPTIMIZER_FILE = "optimizer.pt"
METRICS_FILE = "update_metrics.json"


def shard_for_rank(n: int, mini: int, rank: int, world: int) -> list[int]:
    """Indices of this rank's rows: the rank-th contiguous slice of every mini-batch of `mini` rows."""
    per = mini // world
    return [m + rank * per + j for m in range(0, n, mini) for j in range(per)]


def _worker_rows(job: dict, rank: int, world: int) -> dict:
    from stages.store import read_partition

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


def train_loop_per_worker(job: dict) -> None:
    """Ray Train entry point (also callable with world size 1 and no process group)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from configs.schema import ActorConfig
    from stages.models import load_policy, save_policy
    from stages.trainer import make_optimizer, ppo_update

    torch.set_num_threads(job.get("threads_per_worker", 1))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    actor_cfg = ActorConfig.model_validate(job["actor"])
    torch.manual_seed(job["seed"] * 1000 + rank)
    t0 = time.perf_counter()
    model, tok = load_policy(job["policy_dir"])
    opt, sched = make_optimizer(model, actor_cfg.optim)
    opt_path = Path(job["policy_dir"]) / OPTIMIZER_FILE
    if opt_path.is_file():
        state = torch.load(opt_path, weights_only=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
    ddp = DistributedDataParallel(model) if world > 1 else None
    rows = _worker_rows(job, rank, world)
    t_load = time.perf_counter() - t0
    metrics = ppo_update(model, opt, sched, rows, actor_cfg, n_per_prompt=job["n_per_prompt"],
                         pad_id=tok.pad_token_id, seed=job["seed"], ddp_model=ddp)
    metrics["timing_s/update_load"] = t_load
    metrics["timing_s/update_compute"] = time.perf_counter() - t0 - t_load
    if rank == 0:
        out = Path(job["out_dir"])
        tmp = out.with_name(out.name + ".tmp")
        save_policy(model, tok, tmp)
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / OPTIMIZER_FILE)
        (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=1, sort_keys=True))
        if out.exists():  # a retried attempt replaces its own earlier output
            import shutil
            shutil.rmtree(out)
        os.replace(tmp, out)  # atomic: a checkpoint is either complete or absent


def run_policy_update(job: dict, *, num_workers: int, storage_path: str, name: str) -> dict[str, float]:
    """Run one update through Ray Train; returns the metrics rank 0 wrote next to the checkpoint."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    t0 = time.perf_counter()
    loop = train_loop_per_worker
    if job["actor"].get("strategy", "torch") == "megatron":
        from stages.megatron import train_loop_per_worker as loop  # type: ignore[no-redef]
    trainer = TorchTrainer(
        loop, train_loop_config=job,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=False,
                                     resources_per_worker={"CPU": job.get("threads_per_worker", 1)}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=storage_path, name=name),
    )
    trainer.fit()
    path = Path(job["out_dir"]) / METRICS_FILE
    metrics = json.loads(path.read_text())
    metrics["timing_s/update"] = time.perf_counter() - t0  # includes Ray Train start-up
    path.write_text(json.dumps(metrics, indent=1, sort_keys=True))
    return metrics
