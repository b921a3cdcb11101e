"""Training throughput on CPU: torch backend vs Megatron-Core TP=1 / TP=2 / PP=2 (gloo).

Each configuration runs one PPO policy update (old log-prob recompute + forward/backward over
micro-batches + AdamW step) on the same synthetic batch, once to warm up and `--repeats` times
timed, in fresh processes with torch.set_num_threads(threads). Training tokens/s = real
(non-pad) prompt + response tokens of the batch x ppo_epochs / wall seconds of one update
(median over repeats; the best repeat is printed too, since on a shared 2-core machine other
processes inflate single repeats), measured on rank 0 between barriers.

    python bench/train_throughput.py --hidden 512 --layers 4 --out bench_train.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.io.ports import free_port

if TYPE_CHECKING:
    from configs.schema import ActorConfig

# name -> (backend, world, threads per process, tp, pp)
CONFIGS = {
    "torch 1 proc x 1 thread": ("torch", 1, 1, 1, 1),
    "torch 1 proc x 2 threads": ("torch", 1, 2, 1, 1),
    "torch DDP 2 procs x 1 thread": ("torch", 2, 1, 1, 1),
    "megatron TP=1 (1 proc)": ("megatron", 1, 1, 1, 1),
    "megatron TP=2 (2 procs)": ("megatron", 2, 1, 2, 1),
    "megatron PP=2 (2 procs)": ("megatron", 2, 1, 1, 2),
}


def _rows(n: int, p_len: int, r_len: int, vocab: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(
            5, vocab, (int(torch.randint(p_len // 2, p_len + 1, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n)
    ]
    responses = [
        torch.randint(
            1, vocab, (int(torch.randint(r_len // 2, r_len + 1, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n)
    ]
    return {"prompt_token_ids": prompts, "response_token_ids": responses, "advantages": torch.randn(n, generator=gen)}


def _take(rows: dict, idx: list[int]) -> dict:
    return {
        "prompt_token_ids": [rows["prompt_token_ids"][i] for i in idx],
        "response_token_ids": [rows["response_token_ids"][i] for i in idx],
        "advantages": rows["advantages"][idx],
    }


def _setup_torch(hf, actor_cfg: ActorConfig, world: int):
    from torch.nn.parallel import DistributedDataParallel

    from stages.train.actor import ppo_update
    from stages.train.optim import make_optimizer

    opt, sched = make_optimizer(hf, actor_cfg.optim)
    ddp = DistributedDataParallel(hf) if world > 1 else None
    return lambda rows, npp: ppo_update(hf, opt, sched, rows, actor_cfg, n_per_prompt=npp, pad_id=0, ddp_model=ddp)


def _setup_megatron(hf, actor_cfg: ActorConfig, tp: int, pp: int):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from stages.train.megatron.convert import hf_to_megatron
    from stages.train.megatron.cpu_patches import apply_cpu_patches
    from stages.train.megatron.model import build_gpt_model, hf_arch
    from stages.train.megatron.ppo import megatron_ppo_update
    from stages.train.optim import make_optimizer

    apply_cpu_patches()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(0)
    arch = hf_arch(hf.config)
    model = build_gpt_model(arch, tp, pp)
    model.load_state_dict(
        hf_to_megatron(
            hf.state_dict(),
            arch,
            tp=tp,
            pp=pp,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
        )
    )
    opt, sched = make_optimizer(model, actor_cfg.optim)
    return lambda rows, npp: megatron_ppo_update(
        model,
        opt,
        sched,
        rows,
        actor_cfg,
        vocab_size=arch.vocab_size,
        tied=arch.tied,
        n_per_prompt=npp,
        pad_id=0,
        micro_batch_size=actor_cfg.ppo_micro_batch_size,
    )


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, name: str, out: str) -> None:
    import torch.distributed as dist

    from configs.schema import ActorConfig, TinyModelConfig
    from stages.models.tiny import build_tiny_model
    from stages.workers.actor_worker import shard_for_rank

    backend, _, threads, tp, pp = CONFIGS[name]
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tiny = TinyModelConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.ffn,
    )
    hf = build_tiny_model(tiny, args.vocab, seed=0)
    n = args.rollouts
    actor_cfg = ActorConfig(
        ppo_mini_batch_size=n // args.n_per_prompt, ppo_micro_batch_size=args.micro, optim={"lr": 1e-5}
    )
    rows = _rows(n, args.prompt_len, args.response_len, args.vocab)
    dp = world // (tp * pp)
    dp_rank = rank % (world // pp) // tp  # megatron's rank order: TP fastest, then DP, then PP
    local = _take(rows, shard_for_rank(n, n, dp_rank, dp))
    step = _setup_torch(hf, actor_cfg, world) if backend == "torch" else _setup_megatron(hf, actor_cfg, tp, pp)
    times = []
    for i in range(args.repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        step(local, args.n_per_prompt)
        dist.barrier()
        if i:  # the first run warms up
            times.append(time.perf_counter() - t0)
    if rank == 0:
        tokens = sum(len(p) + len(r) for p, r in zip(rows["prompt_token_ids"], rows["response_token_ids"]))
        sec = statistics.median(times)
        Path(out).write_text(
            json.dumps({"config": name, "seconds": sec, "tokens": tokens, "tokens_per_s": tokens / sec, "times": times})
        )
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=84)
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--n-per-prompt", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="rollouts per micro-batch (per worker)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--response-len", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--out", default="bench_train_throughput.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = []
    for name in args.configs:
        world = CONFIGS[name][1]
        port = free_port()
        tmp = f"{args.out}.part"
        mp.spawn(_worker, args=(world, port, args, name, tmp), nprocs=world, join=True)
        results.append(json.loads(Path(tmp).read_text()))
        os.remove(tmp)
        print(
            f"{name:32s} {results[-1]['tokens_per_s']:9.0f} tokens/s  ({results[-1]['seconds']:.2f} s/update)",
            flush=True,
        )
    base = results[0]["tokens_per_s"]
    print("\n| configuration | s / update (median) | training tokens/s (median) | best repeat tokens/s | vs first |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        best = r["tokens"] / min(r["times"])
        print(
            f"| {r['config']} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} | {best:.0f} | "
            f"{r['tokens_per_s'] / base:.2f}x |"
        )
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "loadavg": os.getloadavg(), "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
