"""Padded against packed: the old-log-prob pass and the policy update of SmolLM2-135M with actor.use_dynamic_bsz off
(micro-batches of actor.ppo_micro_batch_size rows padded to the batch's longest prompt and response) and on
(micro-batches by a token budget, each packed into one row without padding; stages/train/packing.py), on the batch
shape of a config (default configs/smollm2_gsm8k_cpu.yaml; the rows are bench/bf16_update.py's: the task's real
few-shot prompts x worked-solution responses cut to a uniform length in [max_response / 4, max_response]).

Per mode, from a fresh load (same seed): the log-prob pass (stages.train.actor.compute_logprobs, what the
old_logprobs stage and the reference worker run), then ppo_update with those old log-probs, each timed in wall and
this process's CPU seconds. Reported: the padding share of the tokens each forward computes, real tokens/s (prompt
+ response tokens, no padding, over wall and CPU seconds), the speed-up, and how far the two updates are apart
(metrics; weight distance over the padded step).

    nice -n 10 python bench/packing.py --prompts 4 --out bench_packing.json
    python bench/packing.py --prompts 1 --samples 4 --max-response 16   # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bf16_update import cpu_facts, make_rows

from configs.schema import RunConfig, load_config
from stages.models.policy import load_policy
from stages.models.smollm2 import resolve_model_path
from stages.train.actor import compute_logprobs, ppo_update
from stages.train.batching import actor_batch, logprob_temperature
from stages.train.optim import make_optimizer
from stages.train.packing import padding_share

MODES = ("padded", "packed")


def timed(fn):
    """(fn(), wall s, this process's CPU s)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def run_mode(model_dir: str, cfg: RunConfig, rows: dict, mode: str, args) -> dict:
    """Log-prob pass + update of a fresh load with use_dynamic_bsz off (padded) or on (packed)."""
    n_samples = args.samples or cfg.rollout.n
    mini = min(cfg.actor.ppo_mini_batch_size, len(rows["response_token_ids"]) // n_samples)
    update = {"ppo_mini_batch_size": mini, "use_dynamic_bsz": mode == "packed"}
    update |= {"ppo_max_token_len_per_gpu": args.budget, "log_prob_max_token_len_per_gpu": args.budget}
    actor = type(cfg.actor).model_validate({**cfg.actor.model_dump(), **update})
    temperature = logprob_temperature(cfg.rollout.temperature)
    torch.manual_seed(args.seed)
    model, tok = load_policy(model_dir)
    opt, sched = make_optimizer(model, actor.optim)
    model.eval()
    batch = actor_batch(rows, tok.pad_token_id, use_kl_loss=False)
    budget = args.budget if mode == "packed" else None
    old, t_old, c_old = timed(
        lambda: compute_logprobs(model, batch, actor.ppo_micro_batch_size, temperature, max_token_len=budget)
    )
    with_old = {**rows, "old_logprobs": [old[i, : len(r)].tolist() for i, r in enumerate(rows["response_token_ids"])]}
    metrics, t_up, c_up = timed(
        lambda: ppo_update(
            model,
            opt,
            sched,
            with_old,
            actor,
            n_per_prompt=n_samples,
            pad_id=tok.pad_token_id,
            seed=args.seed,
            temperature=temperature,
        )
    )
    real = float(batch["attention_mask"].sum())
    return {
        "padding_share": padding_share(batch["attention_mask"]) if mode == "padded" else 0.0,
        "real_tokens": real,
        "logprob_s": t_old,
        "logprob_cpu_s": c_old,
        "update_s": t_up,
        "update_cpu_s": c_up,
        "logprob_tokens_per_s": real / t_old,
        "logprob_tokens_per_cpu_s": real / c_old,
        "update_tokens_per_s": real / t_up,
        "update_tokens_per_cpu_s": real / c_up,
        "metrics": {k: metrics[k] for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm")},
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "old": old,
        "mask": batch["response_mask"].bool(),
    }


def compare(res: dict, model_dir: str) -> dict:
    """Speed-ups (wall and CPU) and the distance between the two updates and the two log-prob passes."""
    a, b = res["padded"], res["packed"]
    w0 = load_policy(model_dir)[0].state_dict()
    diff = torch.cat([(a["weights"][k] - b["weights"][k]).flatten() for k in w0]).norm()
    step = torch.cat([(a["weights"][k] - w0[k]).flatten() for k in w0]).norm()
    return {
        "speedup_logprob": a["logprob_s"] / b["logprob_s"],
        "speedup_logprob_cpu": a["logprob_cpu_s"] / b["logprob_cpu_s"],
        "speedup_update": a["update_s"] / b["update_s"],
        "speedup_update_cpu": a["update_cpu_s"] / b["update_cpu_s"],
        "weight_diff_over_padded_step": float(diff / step),
        "logprob_abs_diff_max": float((a["old"] - b["old"]).abs()[a["mask"]].max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2_gsm8k_cpu.yaml")
    ap.add_argument("--prompts", type=int, default=None, help="default: data.train_batch_size")
    ap.add_argument("--samples", type=int, default=None, help="default: rollout.n")
    ap.add_argument("--max-response", type=int, default=None, help="default: data.max_response_length")
    ap.add_argument("--budget", type=int, default=2048, help="token budget of a packed micro-batch (both passes)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON of the results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    model_dir = resolve_model_path(cfg.model.path)
    tok = load_policy(model_dir)[1]
    max_resp = args.max_response or cfg.data.max_response_length
    rows = make_rows(cfg, tok, args.prompts or cfg.data.train_batch_size, args.samples or cfg.rollout.n, max_resp)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    shape = {"date": datetime.now(UTC).isoformat(timespec="minutes"), "commit": commit, **cpu_facts()}
    shape |= {"rollouts": len(rows["response_token_ids"]), "threads": args.threads, "budget": args.budget}
    shape |= {"ppo_micro_batch_size": cfg.actor.ppo_micro_batch_size, "torch": torch.__version__}
    print(json.dumps(shape), flush=True)
    res = {}
    for mode in MODES:
        res[mode] = r = run_mode(model_dir, cfg, rows, mode, args)
        print(f"{mode}: padding {r['padding_share']:.1%}, log-probs {r['logprob_s']:.1f} s "
              f"({r['logprob_cpu_s']:.1f} CPU-s), update {r['update_s']:.1f} s ({r['update_cpu_s']:.1f} CPU-s)",
              flush=True)  # fmt: skip
    drop = ("weights", "old", "mask")
    out = {"shape": shape, **{m: {k: v for k, v in res[m].items() if k not in drop} for m in MODES}}
    out |= compare(res, model_dir)
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
