"""How sensitive is the tiny policy's warm start to the seed and to float rounding?

    python bench/warmstart_sensitivity.py --seeds 0,1,2,3 --threads 1,2 [key.sub=value ...]

For each (seed, SFT thread count) it builds policy v0 exactly as the main job does
(`stages.initial_policy.create_initial_policy`) and validates it on the held-out split in-process
(`stages.evaluate.validate_policy`, HF engine). A different thread count changes only the order of
float sums, i.e. what another CPU would do. Results: docs/reproducibility.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from configs.schema import load_config
from stages.evaluate import validate_policy
from stages.initial_policy import create_initial_policy
from stages.models import tiny as models
from stages.models.policy import load_tokenizer
from stages.prompts import build_prompt_rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--threads", default="1", help="SFT thread counts to try (the warm start pins 1)")
    p.add_argument("override", nargs="*")
    args = p.parse_args()
    cfg = load_config(args.config, ["rollout.name=hf", *args.override])
    rows = build_prompt_rows(cfg)
    train, val = rows[rows["split"] == "train"], rows[rows["split"] == "val"]
    tiny = cfg.model.tiny
    print(
        f"warm start {tiny.warmstart_steps} steps (target loss {tiny.warmstart_target_loss}) x batch {tiny.warmstart_batch_size}, lr {tiny.warmstart_lr}; "
        f"{min(len(val), cfg.data.val_batch_size)} held-out problems"
    )
    print("| seed | SFT threads | SFT steps | last SFT loss | held-out greedy | held-out sampled | seconds |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    set_threads = torch.set_num_threads
    for threads in (int(t) for t in args.threads.split(",")):
        models.torch.set_num_threads = lambda n, t=threads: set_threads(t)  # warmstart_sft pins 1; force t
        for seed in (int(s) for s in args.seeds.split(",")):
            t0, out = time.perf_counter(), Path(tempfile.mkdtemp()) / "policy_v0"
            meta = create_initial_policy(cfg.model, train, out, seed=seed)
            m = validate_policy(str(out), val, load_tokenizer(out), cfg, use_ray=False)
            greedy = next(v for k, v in m.items() if k.startswith("val-core/") and k.endswith("mean@1"))
            sampled = next(v for k, v in m.items() if k.startswith("val-aux/") and "/reward/" in k)
            print(
                f"| {seed} | {threads} | {meta['warmstart_steps']} | {meta['warmstart_last_loss']:.4f} | {greedy:.3f} | {sampled:.3f} | "
                f"{time.perf_counter() - t0:.0f} |",
                flush=True,
            )
    models.torch.set_num_threads = set_threads
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
