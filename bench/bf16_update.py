"""bf16 against fp32: the same policy update (same batch, same seed) in three precision modes, on a config's
model and batch shape (default configs/smollm2_gsm8k_cpu.yaml): float32; bfloat16 (actor.mixed_precision.
param_dtype=bfloat16: autocast over float32 parameters); fp32_master (param_dtype=bfloat16 with
master_weights=fp32_master: bf16 parameters, float32 AdamW masters, stages/train/master.py).

Per mode, in a fresh child process (so its peak RSS is its own), from a fresh load of the checkpoint: the
old_logprobs stage's recomputation (stages.train.actor.compute_logprobs, what ActorWorker.compute_log_prob runs)
and then the update (stages.train.actor.ppo_update with those old log-probs, as the pipeline's update), each
timed; the peak RSS during both (sampled every 10 ms, bench/lora_update.py's PeakRss) and the bytes of the
parameters, the masters and the AdamW state. Then the updates are compared with float32's: metrics side by
side, and the distance between the updated (float32 or master) weight sets against the size of the fp32 step.

The batch has the config's shape: data.train_batch_size prompts of the config's task (the real few-shot
word-problem prompts, chat-encoded) x rollout.n responses. The responses are not sampled (an HF generate of
64 x 128 tokens would take longer than the update): each is worked-solution text of the task's problems
("... #### N"), cut to a length drawn uniformly from [max_response_length / 4, max_response_length] (mean
about 83 tokens at 128, the SmolLM2 run's first-iteration mean), with GRPO-normalised random rewards.
Time depends on the shapes only; the metric comparison is on this text. Wall seconds and this process's CPU
seconds (time.process_time, all its threads) are both reported: on a shared machine the wall time includes
waiting for the cores, the CPU time much less so.

    nice -n 10 python bench/bf16_update.py --out bench_bf16.json
    nice -n 10 python bench/bf16_update.py --prompts 2 --samples 8 --max-response 64   # a smaller shape
    python bench/bf16_update.py --prompts 2 --samples 4 --max-response 32 --modes float32 fp32_master  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lora_update import PeakRss
from configs.schema import RunConfig, load_config
from stages.algos.advantages import compute_grpo_advantages
from stages.data.word_problems import generate_word_problem_task
from stages.models.policy import encode_chat, load_policy
from stages.models.smollm2 import resolve_model_path
from stages.run.machine import cpu_flags, cpu_model
from stages.train.actor import compute_logprobs, ppo_update
from stages.train.batching import actor_batch, logprob_temperature
from stages.train.master import float32_params
from stages.train.optim import make_optimizer

MODES = {
    "float32": {"param_dtype": "float32"},
    "bfloat16": {"param_dtype": "bfloat16"},
    "fp32_master": {"param_dtype": "bfloat16", "master_weights": "fp32_master"},
}
"""Each mode's actor.mixed_precision ('bfloat16' is the autocast mode)."""
COMPUTE = (torch.float32, torch.bfloat16)
COMPARED = ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm")


def make_rows(cfg: RunConfig, tok, n_prompts: int, n_samples: int, max_response: int, seed: int = 0) -> dict:
    """ppo_update's rows: the task's first n_prompts training prompts x n_samples solution-text responses."""
    with tempfile.TemporaryDirectory() as tmp:
        train, _ = generate_word_problem_task(tmp, cfg.data.synthetic)
        df = pd.read_parquet(train)
    prompts = [encode_chat(tok, list(df["prompt"].iloc[i]))[0] for i in range(n_prompts)]
    text = "\n\n".join(str(x["answer"]) for x in df["extra_info"].iloc[:200])
    words = tok(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    rows: dict = {"prompt_token_ids": [], "response_token_ids": []}
    for p in prompts:
        for _ in range(n_samples):
            length = rng.randint(max(1, max_response // 4), max_response)
            start = rng.randrange(0, len(words) - length)
            rows["prompt_token_ids"].append(p)
            rows["response_token_ids"].append(words[start : start + length])
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(n_prompts * n_samples, generator=gen) < 0.3).float()  # (N,) a 30% success rate
    groups = torch.arange(n_prompts).repeat_interleave(n_samples)  # (N,)
    rows["advantages"] = compute_grpo_advantages(rewards, groups)
    return rows


def cpu_facts() -> dict:
    """The CPU's model name and whether it has bf16 matmul instructions (avx512_bf16, AMX), from /proc/cpuinfo."""
    return {"cpu": cpu_model(), "bf16_flags": sorted(cpu_flags() & {"avx512_bf16", "amx_bf16", "amx_tile"})}


def matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of an n x n matmul at dtype (the issue's 2048 x 2048 probe), best of `repeats`."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def tensor_mb(tensors) -> float:
    """MiB of `tensors` (each counted once, by storage pointer: tied weights are one)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    return sum(seen.values()) / 2**20


def run_one(model_dir: str, cfg: RunConfig, rows: dict, mode: str, seed: int, n_samples: int) -> dict:
    """Old log-probs + update of a fresh load in `mode` (MODES); timings, memory, metrics and the updated
    (float32: fp32_master's masters) weights."""
    n_prompts = len(rows["response_token_ids"]) // n_samples
    # the config's actor, in this mode; a smoke run's fewer prompts make one mini-batch
    mini = min(cfg.actor.ppo_mini_batch_size, n_prompts)
    actor = type(cfg.actor).model_validate(
        {**cfg.actor.model_dump(), "mixed_precision": MODES[mode], "ppo_mini_batch_size": mini}
    )
    param_dtype, temperature = actor.mixed_precision.param_dtype, logprob_temperature(cfg.rollout.temperature)
    torch.manual_seed(seed)
    model, tok = load_policy(model_dir)
    opt, sched = make_optimizer(model, actor.optim, actor.mixed_precision.master_weights)
    model.eval()
    with PeakRss() as peak:
        t0, c0 = time.perf_counter(), time.process_time()
        batch = actor_batch(rows, tok.pad_token_id, use_kl_loss=False)
        old = compute_logprobs(model, batch, actor.ppo_micro_batch_size, temperature, param_dtype=param_dtype)  # (N, L)
        t_old, c_old = time.perf_counter() - t0, time.process_time() - c0
        with_old = {
            **rows,
            "old_logprobs": [old[i, : len(r)].tolist() for i, r in enumerate(rows["response_token_ids"])],
        }
        t1, c1 = time.perf_counter(), time.process_time()
        kw = {"n_per_prompt": n_samples, "pad_id": tok.pad_token_id, "seed": seed, "temperature": temperature}
        metrics = ppo_update(model, opt, sched, with_old, actor, **kw)
        t_update, c_update = time.perf_counter() - t1, time.process_time() - c1
    with float32_params(opt):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "old_logprobs_s": t_old,
        "update_s": t_update,
        "old_logprobs_cpu_s": c_old,
        "update_cpu_s": c_update,
        "peak_rss_mb": peak.peak_mb,
        "params_mb": tensor_mb(list(model.parameters())),
        "masters_mb": tensor_mb(getattr(opt, "masters", [])),
        "adamw_state_mb": tensor_mb([t for st in opt.state.values() for t in st.values() if t.dim() > 0]),
        "metrics": metrics,
        "weights": weights,
        "old": old,
    }


def in_child(args: argparse.Namespace, mode: str, result: Path) -> dict:
    """run_one in a fresh process (this script with --mode), its result read back from `result`."""
    knobs = ("config", "prompts", "samples", "max_response", "threads", "seed")
    cmd = [sys.executable, __file__, "--mode", mode, "--result", str(result)]
    cmd += [
        x for k in knobs if getattr(args, k) is not None for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))
    ]
    subprocess.run(cmd, check=True)
    return torch.load(result, weights_only=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2_gsm8k_cpu.yaml")
    ap.add_argument("--prompts", type=int, default=None, help="default: data.train_batch_size")
    ap.add_argument("--samples", type=int, default=None, help="default: rollout.n")
    ap.add_argument("--max-response", type=int, default=None, help="default: data.max_response_length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="float32 is always run")
    ap.add_argument("--mode", choices=list(MODES), help="run one mode here (the child process)")
    ap.add_argument("--result", default=None, help="the child's result file (torch.save)")
    ap.add_argument("--out", default=None, help="JSON of the results")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    model_dir = resolve_model_path(cfg.model.path)
    _, tok = load_policy(model_dir)
    n_prompts = args.prompts or cfg.data.train_batch_size
    n_samples = args.samples or cfg.rollout.n
    rows = make_rows(cfg, tok, n_prompts, n_samples, args.max_response or cfg.data.max_response_length, args.seed)
    if args.mode:
        torch.save(run_one(model_dir, cfg, rows, args.mode, args.seed, n_samples), args.result)
        return
    shape = {
        "rollouts": len(rows["response_token_ids"]),
        "max_prompt_tokens": max(map(len, rows["prompt_token_ids"])),
        "mean_response_tokens": sum(map(len, rows["response_token_ids"])) / len(rows["response_token_ids"]),
        "ppo_micro_batch_size": cfg.actor.ppo_micro_batch_size,
        "threads": args.threads,
        **cpu_facts(),
        "matmul_2048_gflops": {str(d).removeprefix("torch."): round(matmul_gflops(d)) for d in COMPUTE},
    }
    print(json.dumps(shape), flush=True)
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in ["float32", *(m for m in args.modes if m != "float32")]:
            res[m] = r = in_child(args, m, Path(tmp) / f"{m}.pt")
            print(
                f"{m}: old_logprobs {r['old_logprobs_s']:.1f} s ({r['old_logprobs_cpu_s']:.1f} CPU-s), update "
                f"{r['update_s']:.1f} s ({r['update_cpu_s']:.1f} CPU-s), peak RSS {r['peak_rss_mb']:.0f} MiB",
                flush=True,
            )
    out = {"shape": shape, **compare(res, model_dir, rows, tok.pad_token_id)}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def compare(res: dict, model_dir: str, rows: dict, pad_id: int) -> dict:
    """Per mode (run_one's results): timings, speed-ups over float32, memory, metrics, and how far its updated
    weights are from float32's (against the fp32 step) and its old log-probs (per response token)."""
    a = res["float32"]
    w0 = load_policy(model_dir)[0].state_dict()
    step = torch.cat([(a["weights"][k] - w0[k]).flatten() for k in w0]).norm()
    mask = actor_batch(rows, pad_id, use_kl_loss=False)["response_mask"].bool()
    timed = ("old_logprobs_s", "update_s", "old_logprobs_cpu_s", "update_cpu_s")
    memory = ("peak_rss_mb", "params_mb", "masters_mb", "adamw_state_mb")
    out: dict = {k: {m: r[k] for m, r in res.items()} for k in (*timed, *memory)}
    out["speedup_update"] = {m: a["update_s"] / r["update_s"] for m, r in res.items()}
    out["speedup_update_cpu"] = {m: a["update_cpu_s"] / r["update_cpu_s"] for m, r in res.items()}
    out["speedup_old_logprobs"] = {m: a["old_logprobs_s"] / r["old_logprobs_s"] for m, r in res.items()}
    out["metrics"] = {m: {k: r["metrics"].get(k) for k in COMPARED} for m, r in res.items()}
    out["weight_diff_over_fp32_step"] = {
        m: float(torch.cat([(a["weights"][k] - r["weights"][k]).flatten() for k in w0]).norm() / step)
        for m, r in res.items()
    }
    gaps = {m: (a["old"] - r["old"]).abs()[mask] for m, r in res.items()}
    out["old_logprob_abs_diff_mean"] = {m: float(g.mean()) for m, g in gaps.items()}
    out["old_logprob_abs_diff_max"] = {m: float(g.max()) for m, g in gaps.items()}
    return out


if __name__ == "__main__":
    main()
