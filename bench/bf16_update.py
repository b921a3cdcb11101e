"""bf16 against fp32: the same policy update (same batch, same seed) at actor.mixed_precision.param_dtype
float32 and bfloat16, on a config's model and batch shape (default configs/smollm2_gsm8k_cpu.yaml).

Per precision, in this process, from a fresh load of the checkpoint: the old_logprobs stage's recomputation
(stages.train.actor.compute_logprobs, what ActorWorker.compute_log_prob runs) and then the update
(stages.train.actor.ppo_update with those old log-probs, as the pipeline's update), each timed. Then the two
updates are compared: metrics side by side, and the distance between the two updated weight sets against
the size of the fp32 step.

The batch has the config's shape: data.train_batch_size prompts of the config's task (the real few-shot
word-problem prompts, chat-encoded) x rollout.n responses. The responses are not sampled (an HF generate of
64 x 128 tokens would take longer than the update): each is worked-solution text of the task's problems
("... #### N"), cut to a length drawn uniformly from [max_response_length / 4, max_response_length] (mean
about 83 tokens at 128, the SmolLM2 run's first-iteration mean), with GRPO-normalised random rewards.
Time depends on the shapes only; the metric comparison is on this text. Wall seconds and this process's CPU
seconds (time.process_time, all its threads) are both reported: on a shared machine the wall time includes
waiting for the cores, the CPU time much less so.

    nice -n 10 python bench/bf16_update.py --out bench_bf16.json
    python bench/bf16_update.py --prompts 2 --samples 4 --max-response 32   # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.schema import RunConfig, load_config
from stages.algos.advantages import compute_grpo_advantages
from stages.data.word_problems import generate_word_problem_task
from stages.models.policy import encode_chat, load_policy
from stages.models.smollm2 import resolve_model_path
from stages.run.machine import cpu_flags, cpu_model
from stages.train.actor import compute_logprobs, ppo_update
from stages.train.batching import actor_batch, logprob_temperature
from stages.train.optim import make_optimizer

PRECISIONS = ("float32", "bfloat16")
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


def run_one(model_dir: str, cfg: RunConfig, rows: dict, param_dtype: str, seed: int, n_samples: int) -> dict:
    """Old log-probs + update of a fresh load at param_dtype; timings, metrics and the updated weights."""
    n_prompts = len(rows["response_token_ids"]) // n_samples
    # the config's actor, at param_dtype; a smoke run's fewer prompts make one mini-batch
    mini = min(cfg.actor.ppo_mini_batch_size, n_prompts)
    update = {"mixed_precision": {"param_dtype": param_dtype}, "ppo_mini_batch_size": mini}
    actor = type(cfg.actor).model_validate({**cfg.actor.model_dump(), **update})
    temperature = logprob_temperature(cfg.rollout.temperature)
    torch.manual_seed(seed)
    model, tok = load_policy(model_dir)
    opt, sched = make_optimizer(model, actor.optim)
    model.eval()
    t0, c0 = time.perf_counter(), time.process_time()
    batch = actor_batch(rows, tok.pad_token_id, use_kl_loss=False)
    old = compute_logprobs(model, batch, actor.ppo_micro_batch_size, temperature, param_dtype=param_dtype)  # (N, L)
    t_old, c_old = time.perf_counter() - t0, time.process_time() - c0
    with_old = {**rows, "old_logprobs": [old[i, : len(r)].tolist() for i, r in enumerate(rows["response_token_ids"])]}
    t1, c1 = time.perf_counter(), time.process_time()
    metrics = ppo_update(
        model,
        opt,
        sched,
        with_old,
        actor,
        n_per_prompt=n_samples,
        pad_id=tok.pad_token_id,
        seed=seed,
        temperature=temperature,
    )
    t_update, c_update = time.perf_counter() - t1, time.process_time() - c1
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "old_logprobs_s": t_old,
        "update_s": t_update,
        "old_logprobs_cpu_s": c_old,
        "update_cpu_s": c_update,
        "metrics": metrics,
        "weights": weights,
        "old": old,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2_gsm8k_cpu.yaml")
    ap.add_argument("--prompts", type=int, default=None, help="default: data.train_batch_size")
    ap.add_argument("--samples", type=int, default=None, help="default: rollout.n")
    ap.add_argument("--max-response", type=int, default=None, help="default: data.max_response_length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON of the results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    model_dir = resolve_model_path(cfg.model.path)
    _, tok = load_policy(model_dir)
    n_prompts = args.prompts or cfg.data.train_batch_size
    n_samples = args.samples or cfg.rollout.n
    rows = make_rows(cfg, tok, n_prompts, n_samples, args.max_response or cfg.data.max_response_length, args.seed)
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
    for p in PRECISIONS:
        res[p] = run_one(model_dir, cfg, rows, p, args.seed, n_samples)
        r = res[p]
        print(
            f"{p}: old_logprobs {r['old_logprobs_s']:.1f} s ({r['old_logprobs_cpu_s']:.1f} CPU-s), "
            f"update {r['update_s']:.1f} s ({r['update_cpu_s']:.1f} CPU-s)",
            flush=True,
        )
    out = {"shape": shape, **compare(res, model_dir, rows, tok.pad_token_id)}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def compare(res: dict, model_dir: str, rows: dict, pad_id: int) -> dict:
    """Timings and speed-ups of run_one's results per precision, their metrics, and how far apart the two
    updates' weights (against the fp32 step) and old log-probs (per response token) are."""
    a, b = res["float32"], res["bfloat16"]
    init, _ = load_policy(model_dir)
    w0 = init.state_dict()
    diff = torch.cat([(a["weights"][k] - b["weights"][k]).flatten() for k in w0]).norm()
    step = torch.cat([(a["weights"][k] - w0[k]).flatten() for k in w0]).norm()
    mask = actor_batch(rows, pad_id, use_kl_loss=False)["response_mask"].bool()
    old_gap = (a["old"] - b["old"]).abs()[mask]
    return {
        "old_logprobs_s": {p: res[p]["old_logprobs_s"] for p in PRECISIONS},
        "update_s": {p: res[p]["update_s"] for p in PRECISIONS},
        "old_logprobs_cpu_s": {p: res[p]["old_logprobs_cpu_s"] for p in PRECISIONS},
        "update_cpu_s": {p: res[p]["update_cpu_s"] for p in PRECISIONS},
        "speedup_update": a["update_s"] / b["update_s"],
        "speedup_update_cpu": a["update_cpu_s"] / b["update_cpu_s"],
        "speedup_old_logprobs": a["old_logprobs_s"] / b["old_logprobs_s"],
        "metrics": {p: {k: res[p]["metrics"].get(k) for k in COMPARED} for p in PRECISIONS},
        "weight_diff_over_fp32_step": float(diff / step),
        "old_logprob_abs_diff_mean": float(old_gap.mean()),
        "old_logprob_abs_diff_max": float(old_gap.max()),
    }


if __name__ == "__main__":
    main()
