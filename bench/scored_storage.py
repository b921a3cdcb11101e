"""Bytes and seconds of the scored_rollouts write as the rollouts grow (#36, token data stored once): a benchmark.

    python bench/scored_storage.py --rollouts 10000,50000 --tokens 256 [--tree DIR ...] [--json out.json]

Per size and code tree (`--tree`, default this checkout; e.g. a `git worktree` of an older commit), a fresh process
writes synthetic rollouts (groups of 8, ~tokens/2 prompt and ~tokens response ids, log-probs, gsm8k `#### N`
answers) as a rollouts partition, then runs the scored_rollouts stage on it in-process (rule reward, the stage
executor, one commit) and reports the Parquet bytes of both partitions and the stage's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def rollouts_frame(n: int, tokens: int):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    resp = rng.integers(tokens // 2, tokens + 1, n)
    answers = rng.integers(0, 1000, n // 8 + 1)[np.arange(n) // 8]
    return pd.DataFrame(
        {
            "policy_version": 0,
            "rollout_id": np.arange(n),
            "prompt_id": np.arange(n) // 8,
            "group_id": np.arange(n) // 8,
            "sample_index": np.arange(n) % 8,
            "data_source": "openai/gsm8k",
            "ground_truth": [str(a) for a in answers],
            "prompt_text": "what does she pay? " * 10,
            "prompt_token_ids": [rng.integers(0, 49152, tokens // 2, dtype=np.int32) for _ in range(n)],
            "response_token_ids": [rng.integers(0, 49152, k, dtype=np.int32) for k in resp],
            "rollout_logprobs": [-rng.exponential(0.5, k).astype(np.float32) for k in resp],
            "response_text": [f"she pays #### {a + (i % 2)}" for i, a in enumerate(answers)],
            "response_length": resp.astype(np.int32),
            "finish_reason": "stop",
            **{"engine": "hf", "engine_sync": "build", "engine_weights_fingerprint": "synthetic"},
        }
    )


def partition_bytes(uri: str) -> int:
    import pyarrow as pa

    from stages.io.store import open_table

    adds = pa.table(open_table(uri).get_add_actions(flatten=True))
    return int(pa.compute.sum(adds["size_bytes"]).as_py())


def one(n: int, tokens: int, work: str) -> dict:
    from configs.schema import RewardConfig
    from stages.io import store
    from stages.scored_rollouts import score_partition

    rollouts, scored = f"{work}/rollouts", f"{work}/scored_rollouts"
    v = store.write_partition(rollouts, "rollouts", rollouts_frame(n, tokens), run_id="s", iteration=0, lineage={})
    t0 = time.perf_counter()
    score_partition(
        RewardConfig(), rollouts, scored, run_id="s", iteration=0, version=v, lineage={}, data_min_rows=None
    )
    seconds = time.perf_counter() - t0
    return {"rows": n, "rollouts_mb": partition_bytes(rollouts) / 2**20, "scored_mb": partition_bytes(scored) / 2**20,
            "score_s": seconds}  # fmt: skip


def storage_args(doc: str) -> argparse.Namespace:
    """The command line of the storage benchmarks (this one, bench/advantages_storage.py)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rollouts", default="10000,50000")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--tree", action="append", help="a code tree to run (default: this checkout); repeatable")
    parser.add_argument("--json", help="write the rows here")
    return parser.parse_args()


def per_tree(script: str, args: argparse.Namespace, prefix: str) -> list[dict]:
    """One fresh process per size and code tree (`script --one N TOKENS WORK RESULT`, run in the tree with it as
    PYTHONPATH): the rows they report, each printed as it comes, written to --json when given."""
    rows = []
    for n in [int(s) for s in args.rollouts.split(",")]:
        for tree in args.tree or [str(HERE)]:
            with tempfile.TemporaryDirectory(prefix=prefix) as work:
                result = Path(work) / "result.json"
                cmd = [sys.executable, script, "--one", str(n), str(args.tokens), work, str(result)]
                subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": tree}, cwd=tree)
                rows.append({"tree": tree, **json.loads(result.read_text())})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        n, tokens, work, result = sys.argv[2:6]
        sys.path.insert(0, os.getcwd())
        Path(result).write_text(json.dumps(one(int(n), int(tokens), work)))
        return 0
    rows = per_tree(__file__, storage_args(__doc__), "rlake-scored-")
    print("| tree | rollouts | rollouts partition MB | **scored_rollouts partition MB** | scoring stage s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        row = f"| {Path(r['tree']).name} | {r['rows']} | {r['rollouts_mb']:.1f} | **{r['scored_mb']:.1f}** |"
        print(f"{row} {r['score_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
