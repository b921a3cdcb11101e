"""Bytes and seconds of the advantages write as the rollouts grow (#36, token data stored once): a benchmark.

    python bench/advantages_storage.py --rollouts 10000,50000 --tokens 256 [--tree DIR ...] [--json out.json]

Per size and code tree (`--tree`, default this checkout; e.g. `git archive eb8774e` unpacked), a fresh process
writes bench/scored_storage.py's synthetic rollouts as a rollouts partition, scores them (the scored_rollouts stage),
writes an old_logprobs partition (a log-prob per response token, as the old_logprobs stage does), then runs the
streamed advantages stage (GRPO) on them in-process and reports the Parquet bytes of the advantages partition
and the stage's seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def one(n: int, tokens: int, work: str) -> dict:
    from types import SimpleNamespace

    import numpy as np
    import pandas as pd
    from scored_storage import partition_bytes, rollouts_frame

    from configs.schema import AlgorithmConfig, RewardConfig
    from stages.advantages import Upstream, stream_advantages
    from stages.io import store
    from stages.io.stage_exec import Partition
    from stages.scored_rollouts import score_partition
    from stages.scored_tokens import ScoredRollouts

    uri = {t: f"{work}/{t}" for t in ("rollouts", "scored_rollouts", "old_logprobs", "advantages")}
    frame = rollouts_frame(n, tokens)
    v = store.write_partition(uri["rollouts"], "rollouts", frame, run_id="s", iteration=0, lineage={})
    kw = {"run_id": "s", "iteration": 0, "lineage": {}}
    sv = score_partition(RewardConfig(), uri["rollouts"], uri["scored_rollouts"], version=v, data_min_rows=None, **kw)
    rng = np.random.default_rng(1)
    old = pd.DataFrame({"rollout_id": frame["rollout_id"], "policy_version": 0,
                        "old_logprobs": [-rng.exponential(0.5, k).astype(np.float32) for k in frame["response_length"]],
                        "rollout_probs_diff_max": 0.1, "rollout_probs_diff_mean": 0.01})  # fmt: skip
    ov = store.write_partition(uri["old_logprobs"], "old_logprobs", old, **kw)
    sv = sv if isinstance(sv, int) else sv.version
    up = Upstream(
        ScoredRollouts(Partition(uri["scored_rollouts"], "s", 0, sv), Partition(uri["rollouts"], "s", 0, v)),
        old=Partition(uri["old_logprobs"], "s", 0, ov),
    )
    cfg = SimpleNamespace(algorithm=AlgorithmConfig(), reward=RewardConfig(), data=SimpleNamespace(train_batch_size=n))
    lineage = {"upstream": {"rollouts": v, "scored_rollouts": sv, "old_logprobs": ov}}
    t0 = time.perf_counter()
    stream_advantages(cfg, up, uri["advantages"], lineage=lineage)
    seconds = time.perf_counter() - t0
    mb = {t: partition_bytes(u) / 2**20 for t, u in uri.items()}
    return {"rows": n, **{f"{t}_mb": b for t, b in mb.items()}, "advantages_s": seconds}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        n, tokens, work, result = sys.argv[2:6]
        sys.path[:0] = [os.getcwd(), str(Path(__file__).parent)]
        Path(result).write_text(json.dumps(one(int(n), int(tokens), work)))
        return 0
    from scored_storage import per_tree, storage_args

    rows = per_tree(__file__, storage_args(__doc__), "rlake-adv-")
    print("| tree | rollouts | rollouts MB | scored_rollouts MB | old_logprobs MB | **advantages MB** | advantages s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mb = " | ".join(f"{r[f'{t}_mb']:.1f}" for t in ("rollouts", "scored_rollouts", "old_logprobs"))
        print(
            f"| {Path(r['tree']).name} | {r['rows']} | {mb} | **{r['advantages_mb']:.1f}** | {r['advantages_s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
