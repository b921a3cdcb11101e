"""Rollout stage vs bare engine: rlake's rollouts stage against the engine called directly, side by side.

For each engine (HF transformers, vLLM) one process measures, interleaved (bare, stage, stage, bare, ...):

- bare: the engine as its users call it, in this process: HF `model.generate` on left-padded token ids
  (the stage's micro-batches: rollout.micro_batch_size sequences per call, `num_return_sequences=n`),
  vLLM `LLM.generate` on `TokensPrompt`s with `SamplingParams(n=...)`; same sampling (temperature, top-p,
  top-k, max tokens, stop strings) and the same seed as the stage; no logprobs asked for.
- stage: `stages.rollouts.sample_rollouts` as the `rollouts` asset calls it: the Ray rollout worker
  (RolloutWorker, its engine kept between calls) generates the batch and returns the rollout rows (token
  ids, per-token logprobs, text, finish reason), sorted and numbered on the driver. Its seconds include
  the Ray round trip and the worker's weight sync check; the worker's engine is built in a warm-up call.

Tokens/s = generated tokens (EOS included, counted as the stage counts them) / wall seconds of one call;
the ratio stage/bare is of the medians over --repeats calls. The prompts are configs/smollm2_gsm8k_cpu.yaml's
(few-shot GSM8K-style word problems, stages/data/word_problems.py, chat-templated), the sampling its
rollout.* (T=0.7, top-p 1, 8 samples, 128 new tokens, stop "\\nQuestion:"), the model SmolLM2-135M-Instruct
(stages.models.smollm2, converted locally; no hub).

    python bench/rollout_stage_vs_engine.py --engines hf,vllm --repeats 3 --out bench_rollout_stage.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from configs.schema import RunConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "configs" / "smollm2_gsm8k_cpu.yaml"


def run_config(args: argparse.Namespace):
    from configs.schema import load_config

    overrides = [
        f"rollout.name={args.worker}",
        f"rollout.n={args.n}",
        f"rollout.temperature={args.temperature}",
        f"data.train_batch_size={args.prompts}",
        f"actor.ppo_mini_batch_size={args.prompts}",
        "actor.ppo_micro_batch_size=1",  # the trainer does not run here; only the config must validate
        f"data.max_response_length={args.max_tokens}",
    ]
    return load_config(CONFIG, overrides)


def prompt_batch(cfg: RunConfig, model_dir: str, work: Path):
    """The first data.train_batch_size word problems of the config's task, as a prompt_batches partition."""
    import pandas as pd

    from stages.data.word_problems import generate_word_problem_task
    from stages.models.policy import load_tokenizer
    from stages.prompt_batches import prompt_batch_frame

    syn = cfg.data.synthetic.model_copy(update={"num_train": cfg.data.train_batch_size, "num_val": 1})
    train, _ = generate_word_problem_task(work / "data", syn)
    rows = pd.read_parquet(train).reset_index(drop=True)
    rows["prompt_id"] = range(len(rows))
    batch = prompt_batch_frame(rows, load_tokenizer(model_dir), cfg.data.max_prompt_length)
    pos = list(range(len(batch)))
    return batch.assign(epoch=0, position=pos, gen_round=0, group_id=pos, policy_version=0)


class BareHF:
    """HF `generate` called directly, in the stage's micro-batches (rollout.micro_batch_size sequences)."""

    def __init__(self, model_dir: str, cfg: RunConfig) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.cfg = cfg

    def generate(self, prompts: list[list[int]], seed: int, max_tokens: int) -> int:
        import torch

        r, tok = self.cfg.rollout, self.tok
        per_call = max(1, r.micro_batch_size // r.n)
        torch.manual_seed(seed)
        tokens = 0
        for start in range(0, len(prompts), per_call):
            enc = tok.pad({"input_ids": prompts[start : start + per_call]}, return_tensors="pt")
            with torch.no_grad():
                out = self.model.generate(
                    **enc,
                    do_sample=True,
                    temperature=r.temperature,
                    top_p=r.top_p,
                    top_k=max(r.top_k, 0),
                    max_new_tokens=max_tokens,
                    num_return_sequences=r.n,
                    stop_strings=list(r.stop) or None,
                    tokenizer=tok,
                    pad_token_id=tok.pad_token_id,
                )
            for row in out[:, enc["input_ids"].shape[1] :].tolist():  # the stage's count: up to the first EOS
                tokens += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        return tokens


class BareVLLM:
    """vLLM's `LLM.generate` called directly, built with the engine's settings (float32, eager, max_num_seqs =
    rollout.micro_batch_size, 1 GiB KV cache, engine core in this process)."""

    def __init__(self, model_dir: str, cfg: RunConfig) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.llm = LLM(
            model=model_dir,
            tokenizer=model_dir,
            dtype="float32",
            enforce_eager=True,
            seed=0,
            max_num_seqs=cfg.rollout.micro_batch_size,
            kv_cache_memory_bytes=1 << 30,
        )
        self.cfg = cfg

    def generate(self, prompts: list[list[int]], seed: int, max_tokens: int) -> int:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        r = self.cfg.rollout
        params = SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k if r.top_k > 0 else -1,
            max_tokens=max_tokens,
            seed=seed,
            stop=list(r.stop) or None,
            include_stop_str_in_output=True,
        )
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)


def stage_call(batch, model_dir: str, cfg: RunConfig, iteration: int) -> tuple[int, float, dict]:
    """One call of the rollouts stage's work (sample_rollouts): (tokens, seconds, the worker's own timings)."""
    from stages.rollouts import sample_rollouts
    from stages.workers.sharded import shard_frames

    t0 = time.perf_counter()  # the rows come back (no sink), for the worker's own timings per row
    out = shard_frames(sample_rollouts(batch, model_dir=model_dir, cfg=cfg, iteration=iteration))
    seconds = time.perf_counter() - t0
    parts = {"worker_generate_s": float(out["generate_s"].max()), "sync_s": float(out["engine_sync_s"].max())}
    return int(out["response_length"].sum()), seconds, parts


# long: the measurement's steps in the order they run (set-up, warm-ups, interleaved repeats)
def run_worker(args: argparse.Namespace) -> dict:
    """Bare engine and stage for one engine, in this process (the stage's worker in a Ray actor)."""
    import torch

    from stages import seeds
    from stages.models.smollm2 import ensure_smollm2_checkpoint
    from stages.workers.connect import ensure_ray_for

    torch.set_num_threads(args.threads)
    model_dir = ensure_smollm2_checkpoint()
    cfg = run_config(args)
    batch = prompt_batch(cfg, model_dir, Path(tempfile.mkdtemp(prefix="rlake-bench-")))
    prompts = [list(map(int, p)) for p in batch["prompt_token_ids"]]
    ensure_ray_for(cfg)
    t0 = time.perf_counter()
    bare = (BareHF if args.worker == "hf" else BareVLLM)(model_dir, cfg)
    bare_build_s = time.perf_counter() - t0
    warm_cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_response_length": 8})})
    t0 = time.perf_counter()
    stage_call(batch, model_dir, warm_cfg, 0)  # builds the worker and its engine
    stage_build_s = time.perf_counter() - t0
    bare.generate(prompts, 0, 8)
    rows = []
    for r in range(args.repeats):
        it = r + 1
        # the seed the stage's one worker samples with (stages.workers.rollout_worker: seeded per shard)
        seed = seeds.engine_shard(seeds.rollout(cfg.rollout.seed, it), int(batch["prompt_id"].min()))
        order = ["bare", "stage"] if r % 2 == 0 else ["stage", "bare"]
        for what in order:
            if what == "bare":
                t0 = time.perf_counter()
                tokens = bare.generate(prompts, seed, args.max_tokens)
                rows.append({"what": "bare", "repeat": r, "tokens": tokens, "s": time.perf_counter() - t0})
            else:
                tokens, s, parts = stage_call(batch, model_dir, cfg, it)
                rows.append({"what": "stage", "repeat": r, "tokens": tokens, "s": s, **parts})
            last = rows[-1]
            print(f"{args.worker} {what:5s} repeat {r}: {last['tokens']} tokens in {last['s']:.1f} s", flush=True)
    return summarize(args, rows, bare_build_s, stage_build_s)


def summarize(args: argparse.Namespace, rows: list[dict], bare_build_s: float, stage_build_s: float) -> dict:
    def med(what: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["what"] == what)

    def rate(what: str) -> float:
        return statistics.median(r["tokens"] / r["s"] for r in rows if r["what"] == what)

    return {
        "engine": args.worker,
        "bare_tokens_per_s": rate("bare"),
        "stage_tokens_per_s": rate("stage"),
        "ratio": rate("stage") / rate("bare"),
        "bare_s": med("bare", "s"),
        "stage_s": med("stage", "s"),
        "bare_tokens": med("bare", "tokens"),
        "stage_tokens": med("stage", "tokens"),
        "stage_worker_generate_s": med("stage", "worker_generate_s"),
        "stage_sync_s": med("stage", "sync_s"),
        "bare_build_s": bare_build_s,
        "stage_build_s": stage_build_s,
        "rows": rows,
    }


def table(results: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"{args.prompts} prompts x {args.n} samples, max {args.max_tokens} new tokens, T={args.temperature}, "
        f"{args.threads} threads, median of {args.repeats} interleaved calls each",
        "",
        "| engine | bare tokens/s | stage tokens/s | stage / bare | bare s (tokens) | stage s (tokens) "
        "| stage: worker generate s | stage: weight sync s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['engine']} | {r['bare_tokens_per_s']:.1f} | {r['stage_tokens_per_s']:.1f} | {r['ratio']:.2f} "
            f"| {r['bare_s']:.1f} ({r['bare_tokens']:.0f}) | {r['stage_s']:.1f} ({r['stage_tokens']:.0f}) "
            f"| {r['stage_worker_generate_s']:.1f} | {r['stage_sync_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--threads", type=int, default=2, help="torch/OMP threads of the bare engine (the stage: 2)")
    ap.add_argument("--out", default="bench_rollout_stage.md", help="markdown table written here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_worker(args)), flush=True)
        return
    results = []
    for engine in args.engines.split(","):
        cmd = [sys.executable, __file__, "--worker", engine, *sys.argv[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        lines = []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
            for line in proc.stdout:
                (lines.append(line) if line.startswith("RESULT ") else print(line, end="", flush=True))
        if proc.returncode != 0 or not lines:
            print(f"{engine} failed (rc={proc.returncode})", file=sys.stderr)
            continue
        results.append(json.loads(lines[-1][len("RESULT ") :]))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rows"}), flush=True)
    text = table(results, args)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
