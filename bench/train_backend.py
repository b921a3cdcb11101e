"""The SmolLM2 policy update on the two trainer backends, actor.worker_backend = worker_group | ray_train
(issue #36 item 2: Ray Train is kept only if it is at most 10% slower than the WorkerGroup).

One local Ray (2 CPUs, as `rlake train`'s default) and, per backend, the run's real update path: `run_update`
(stages/policy_checkpoint.py) -> the "actor" group (a WorkerGroup of named Ray actors, or one Ray Train run:
stages/workers/train_group.py) -> `ActorWorker.update` on every rank. Per round and backend, from a fresh group:
the first update (group start, policy load from disk, update, checkpoint commit) and then `--updates` more, each
from the previous update's output, which the ranks hold resident (the pipeline's steady state). "outside" is a
call's wall time minus the update's own load + compute time as rank 0 measures it (timing_s/update_load +
update_compute): the dispatch and the checkpoint commit, where the two backends differ, and less sensitive to
the machine's load than the wall time. Rounds alternate
the backends (worker_group, ray_train, worker_group, ...), so load drift on a shared machine hits both.

The batch is bench/bf16_update.py's: the task's few-shot prompts x solution-text responses of a length drawn
from [max_response / 4, max_response], GRPO advantages of random rewards, written as an advantages table.

    nice python bench/train_backend.py --prompts 2 --samples 8 --max-response 64 --rounds 2 --updates 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bf16_update import make_rows
from configs.schema import load_config
from stages.io.store import write_partition
from stages.models.policy import load_tokenizer
from stages.models.smollm2 import resolve_model_path
from stages.policy_checkpoint import run_update, update_request
from stages.workers.group import shutdown_worker_groups

BACKENDS = ("worker_group", "ray_train")


def advantages_table(root: Path, rows: dict, n_samples: int) -> tuple[str, int]:
    """rows (make_rows) as iteration 0's advantages partition of run 'bench'; (uri, version)."""
    frame = pd.DataFrame(
        {
            "rollout_id": range(len(rows["advantages"])),
            "group_id": [i // n_samples for i in range(len(rows["advantages"]))],
            "policy_version": 0,
            "prompt_token_ids": rows["prompt_token_ids"],
            "response_token_ids": rows["response_token_ids"],
            "reward": 0.0,
            "advantage": rows["advantages"].tolist(),
            "adv_estimator": "grpo",
        }
    )
    frame["token_advantages"] = [[a] * len(r) for a, r in zip(frame["advantage"], frame["response_token_ids"])]
    uri = str(root / "advantages")
    return uri, write_partition(uri, "advantages", frame, run_id="bench", iteration=0, lineage={})


def one_round(cfg_path: str, backend: str, model_dir: str, table: tuple[str, int], root: Path, updates: int) -> dict:
    """A fresh group of `backend`: the first update from disk, then `updates` resident ones; seconds of each."""
    cfg = load_config(cfg_path, [f"actor.worker_backend={backend}", "trainer.run_id=bench"])
    shutdown_worker_groups()
    policy, times, inside, metrics = model_dir, [], [], {}
    for i in range(updates + 1):
        out = root / f"{backend}-{time.time_ns()}"
        req = update_request(
            cfg, 0, advantages_uri=table[0], advantages_version=table[1], policy_dir=policy, out_dir=out
        )
        t0 = time.perf_counter()
        metrics = run_update(req)
        times.append(time.perf_counter() - t0)
        inside.append(metrics["timing_s/update_load"] + metrics["timing_s/update_compute"])
        policy = str(out)
        assert metrics["actor/weights_loaded_from_disk"] == (1.0 if i == 0 else 0.0), (backend, i, metrics)
    shutdown_worker_groups()
    return {
        "backend": backend,
        "first_s": times[0],
        "resident_s": times[1:],
        "resident_outside_s": [t - u for t, u in zip(times[1:], inside[1:])],
        "pg_loss": metrics["actor/pg_loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smollm2_gsm8k_cpu.yaml")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-response", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--updates", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rlake")
    cfg = load_config(args.config)
    model_dir = str(resolve_model_path(cfg.model.path))
    rows = make_rows(cfg, load_tokenizer(model_dir), args.prompts, args.samples, args.max_response)
    results = []
    with tempfile.TemporaryDirectory(prefix="rlake-bench-backend-") as tmp:
        table = advantages_table(Path(tmp), rows, args.samples)
        for r in range(args.rounds):
            for backend in BACKENDS:
                results.append(one_round(args.config, backend, model_dir, table, Path(tmp), args.updates))
                print(json.dumps({"round": r, **results[-1]}), flush=True)
    summary = {}
    for backend in BACKENDS:
        mine = [x for x in results if x["backend"] == backend]
        summary[backend] = {
            "first_s_median": statistics.median(x["first_s"] for x in mine),
            "resident_s_median": statistics.median(t for x in mine for t in x["resident_s"]),
            "resident_outside_s_median": statistics.median(t for x in mine for t in x["resident_outside_s"]),
            "pg_loss": [x["pg_loss"] for x in mine],
        }
    ratio = summary["ray_train"]["resident_s_median"] / summary["worker_group"]["resident_s_median"]
    summary["ray_train_over_worker_group_resident"] = ratio
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
