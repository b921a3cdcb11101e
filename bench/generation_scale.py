"""The rollouts step's driver memory as the batch grows (#36): a benchmark, not a test.

    python bench/generation_scale.py --rollouts 1000,8000 --max-tokens 128 --json out.json [--tree DIR ...]

Per size and per code tree (`--tree`, default this checkout; e.g. a `git worktree` of an older commit), a FRESH
process (the Dagster step's: the in_process executor runs every step in one) connects to a local Ray, then runs
what the `rollouts` asset runs: `sample_rollouts` over a prompt batch of size / rollout.n synthetic prompts on the
run's rollout worker (tiny_cpu: one HF engine rank, a random tiny model whose EOS logit is zeroed, so responses run
long), and the partition's write with lineage. A tree whose sample_rollouts takes a `sink` (the ranks write their
files, the step commits) is run that way; an older one gets the rows back and writes them (assets/common.py
write_table). Reported: the process's RSS before the step, the step's own peak RSS (reset when it begins), the
rows, the response tokens and the step's seconds.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
RUN, GROUP = "gen", 8


def _reset_peak() -> None:
    """Linux: VmHWM and ru_maxrss back to the RSS now (/proc/self/clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_mb(peak: bool) -> float:
    import psutil

    return resource.getrusage(resource.RUSAGE_SELF)[2] / 1024 if peak else psutil.Process().memory_info().rss / 2**20


def checkpoint(root: Path) -> str:
    """A random tiny Qwen2 + char tokenizer with its EOS row of lm_head zeroed (a rare stop: long responses)."""
    import torch

    from configs.schema import TinyModelConfig
    from stages.models.policy import save_policy
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), len(tok), seed=0)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 0.0
    return str(save_policy(model, tok, root / "policy_v0"))


def prompt_batch(prompts: int, tok):
    """A prompt_batches partition's rows as the rollouts asset gets them (group_id, policy_version set)."""
    import pandas as pd

    from stages.models.policy import encode_chat

    texts = [f"What is {i % 97} plus {(7 * i) % 89}? Answer with #### N." for i in range(prompts)]
    return pd.DataFrame(
        {
            "prompt_id": range(prompts),
            "epoch": 0,
            "position": range(prompts),
            "data_source": "rlake/arith",
            "ground_truth": [str(i % 97 + (7 * i) % 89) for i in range(prompts)],
            "extra_info": None,
            "prompt_text": texts,
            "prompt_token_ids": [encode_chat(tok, [{"role": "user", "content": t}])[0] for t in texts],
            "gen_round": 0,
            "group_id": range(prompts),
            "policy_version": 0,
        }
    )


def one(size: int, max_tokens: int, workdir: str, model_dir: str) -> dict:
    """In a fresh process whose sys.path starts with the tree under test: the rollouts step at `size` rows."""
    from assets.common import lineage
    from assets.resources import RolloutStoreResource
    from configs.schema import load_config
    from stages.models.policy import load_tokenizer
    from stages.rollouts import sample_rollouts
    from stages.workers.connect import ensure_ray_for

    overrides = [f"trainer.output_dir={workdir}", f"trainer.run_id={RUN}", f"rollout.n={GROUP}"]
    cfg = load_config(HERE / "configs" / "tiny_cpu.yaml", [*overrides, f"data.max_response_length={max_tokens}"])
    store = RolloutStoreResource(root=str(Path(workdir) / "tables"))
    batch = prompt_batch(size // GROUP, load_tokenizer(model_dir))
    ensure_ray_for(cfg)
    start = _rss_mb(peak=False)
    _reset_peak()
    t0 = time.perf_counter()
    meta = lineage(cfg, stage="rollouts", policy_version=0, upstream={"prompt_batches": 0}, duration_s=0.0)
    if "sink" in inspect.signature(sample_rollouts).parameters:  # the ranks write, the step commits
        from stages.rollout_shards import merge_summaries
        from stages.workers.shard_io import Sink
        from stages.workers.sharded import commit_shards

        sink = Sink(store.uri("rollouts"), "rollouts", cfg.run_id, 0)
        results = sample_rollouts(batch, model_dir=model_dir, cfg=cfg, iteration=0, sink=sink)
        commit_shards(sink, results, meta)
        done = merge_summaries([r.summary for r in results])
        rows, tokens, how = done["rows"], done["response_tokens"], "ranks write"
    else:  # rows back to the step, which writes them
        out = sample_rollouts(batch, model_dir=model_dir, cfg=cfg, iteration=0)
        store.write("rollouts", out, run_id=cfg.run_id, iteration=0, lineage=meta)
        rows, tokens, how = len(out), int(out["response_length"].sum()), "step writes"
    seconds = time.perf_counter() - t0
    peak = _rss_mb(peak=True)
    return {"rows": rows, "response_tokens": tokens, "how": how, "start_mb": start, "peak_mb": peak, "step_s": seconds}


def measure(trees: list[str], sizes: list[int], max_tokens: int) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory(prefix="rlake-gen-") as tmp:
        sys.path.insert(0, str(HERE))
        model_dir = checkpoint(Path(tmp))
        for size in sizes:
            for tree in trees:  # alternated per size, so the load of the machine hits both alike
                work = tempfile.mkdtemp(dir=tmp)
                result = Path(work) / "result.json"
                env = {**os.environ, "PYTHONPATH": tree}
                cmd = [sys.executable, __file__, "--one", str(size), str(max_tokens), work, model_dir, str(result)]
                subprocess.run(cmd, check=True, env=env, cwd=tree)
                row = {"tree": tree, "size": size, **json.loads(result.read_text())}
                print(json.dumps(row), file=sys.stderr, flush=True)
                out.append(row)
    return out


def table(rows: list[dict]) -> str:
    head = "| tree | how | rollouts | response tokens | RSS before the step MB | **step peak RSS MB** | step s |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {Path(r['tree']).name} | {r['how']} | {r['rows']} | {r['response_tokens']} | {r['start_mb']:.0f} | "
            f"**{r['peak_mb']:.0f}** | {r['step_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        size, max_tokens, work, model_dir, result = sys.argv[2:7]
        sys.path.insert(0, os.getcwd())
        Path(result).write_text(json.dumps(one(int(size), int(max_tokens), work, model_dir)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", default="1000,8000", help="comma-separated batch sizes (rollouts)")
    parser.add_argument("--max-tokens", type=int, default=128, help="data.max_response_length")
    parser.add_argument("--tree", action="append", help="a code tree to run (default: this checkout); repeatable")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = measure(args.tree or [str(HERE)], [int(s) for s in args.rollouts.split(",")], args.max_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
