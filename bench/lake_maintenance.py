"""What table maintenance (stages/io/maintenance.py, `rlake maintain`) buys a long run's lake: a benchmark, not a test.

    python bench/lake_maintenance.py --iterations 300 --blocks 4 --json out.json

Grows one run's tables as bench/scale.py --iterations does (tiny_cpu's GRPO DAG, 8 tables, one 16-row partition per
table per iteration, each commit with its stage's lineage), either written by the store (`--blocks 1`: one file per
partition, store.write_partition) or as `--blocks K` files per partition in one commit (the Ray-block writes of
stages/io/dataset_io.py, without Ray). Copies the lake, runs `maintain_tables` on the original (compact, checkpoint,
VACUUM with 0 h retention keeping the lineage's versions), then times both lakes alternately (`--repeats`, medians):
an `rlake sql` query (connect: a view per table; then the query), and the read of iteration 0's recorded rollouts
version (time travel). Finally counts the files a VACUUM without the lineage's versions would delete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # bench/scale.py: the run, the frames, the DAG's tables

from assets.common import lineage, write_table
from assets.resources import RolloutStoreResource
from configs.schema import RunConfig
from stages.io import dataset_io, sql
from stages.io import store as delta
from stages.io.maintenance import maintain_tables

QUERY = "SELECT metric, avg(value) FROM iteration_metrics GROUP BY metric"


def write_blocks(store, cfg: RunConfig, table: str, frame: pd.DataFrame, it: int, blocks: int, up: dict) -> int:
    """Partition (RUN, it) of `table` as `blocks` Parquet files and one commit with the stage's lineage."""
    uri = store.uri(table)
    files = pd.concat(
        [
            dataset_io.write_block(part, uri=uri, options=None, name=table, run_id=scale.RUN, iteration=it)
            for part in np.array_split(frame, blocks)
        ]
    )
    meta = lineage(cfg, stage=table, policy_version=it, upstream=up, duration_s=0.0)
    return dataset_io.commit_files(
        uri, table, files, run_id=scale.RUN, iteration=it, lineage=meta, storage_options=None
    )


def grow(store, cfg: RunConfig, n: int, blocks: int) -> dict[int, dict[str, int]]:
    """n iterations of every table of the DAG; returns each iteration's versions (what the lineage records)."""
    frames = {t: scale.small_frame(t) for t in scale.ITER_TABLES}
    write_table(store, cfg, "prompts", scale.small_frame("prompts", 64), -1, policy_version=None, upstream={})
    recorded = {}
    for it in range(n):
        versions = {"prompts": 0}
        for table, reads in scale.ITER_TABLES.items():
            up = {t: versions[t] for t in reads}
            if blocks == 1:
                versions[table] = write_table(store, cfg, table, frames[table], it, policy_version=it, upstream=up)
            else:
                versions[table] = write_blocks(store, cfg, table, frames[table], it, blocks, up)
        recorded[it] = versions
    return recorded


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(store, recorded: dict) -> dict:
    """Files the newest versions read, data files on disk and their MB, and one timing of: `rlake sql`'s connect
    (a view per table), the query on it, and the time-travel read of iteration 0's recorded rollouts version."""
    data = [p for p in Path(store.root).rglob("*.parquet") if "_delta_log" not in p.parts]
    holder = {}
    connect = timed(lambda: holder.setdefault("con", sql.connect(store.location)))
    execute = timed(lambda: holder["con"].execute(QUERY).fetchdf())
    uri, version = store.uri("rollouts"), recorded[0]["rollouts"]
    travel = timed(lambda: holder.setdefault("rows", delta.read_partition(uri, scale.RUN, 0, version=version)))
    live = sum(delta.open_table(store.uri(t)).get_add_actions().num_rows for t in [*scale.ITER_TABLES, "prompts"])
    return {
        "live_files": live,
        "data_files": len(data),
        "data_mb": sum(p.stat().st_size for p in data) / 2**20,
        "connect_s": connect,
        "query_s": execute,
        "sql_s": connect + execute,
        "time_travel_s": travel,
        "time_travel_rows": len(holder["rows"]),
    }


def medians(store_a, store_b, recorded: dict, repeats: int) -> tuple[dict, dict]:
    """measure() of both lakes, alternated `repeats` times (the same load on both); the median of each number."""
    runs: dict[int, list[dict]] = {0: [], 1: []}
    for _ in range(repeats):
        for k, st in enumerate((store_a, store_b)):
            runs[k].append(measure(st, recorded))
    return tuple({key: statistics.median(m[key] for m in runs[k]) for key in runs[k][0]} for k in (0, 1))


def run(n: int, blocks: int, repeats: int) -> dict:
    """Grow a lake, keep a copy of it, maintain the original, then measure the copy (before) and it (after)."""
    tmp = Path(tempfile.mkdtemp(prefix="rlake-maint-"))
    cfg, store = scale.run_of(tmp)
    t0 = time.perf_counter()
    recorded = grow(store, cfg, n, blocks)
    out = {"iterations": n, "blocks": blocks, "grow_s": time.perf_counter() - t0}
    shutil.copytree(store.root, tmp / "before")
    t0 = time.perf_counter()
    reports = maintain_tables(store.location, vacuum_retention_hours=0, enforce_retention_duration=False)
    out["maintain_s"] = time.perf_counter() - t0
    out["tables"] = [r.as_dict() for r in reports]
    before = RolloutStoreResource(root=str(tmp / "before"))
    out["before"], out["after"] = medians(before, store, recorded, repeats)
    unkept = maintain_tables(
        store.location,
        compact=False,
        checkpoint=False,
        vacuum_retention_hours=0,
        keep_lineage=False,
        enforce_retention_duration=False,
        dry_run=True,
    )
    out["vacuum_without_lineage_files"] = sum(r.vacuumed_files for r in unkept)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--blocks", default="1,4", help="comma-separated files per partition, e.g. 1,4")
    ap.add_argument("--repeats", type=int, default=5, help="alternated timings of before and after (medians)")
    ap.add_argument("--json", default=None, help="also write the measurements here")
    args = ap.parse_args()
    results = []
    for blocks in (int(b) for b in args.blocks.split(",")):
        res = run(args.iterations, blocks, args.repeats)
        b, a = res["before"], res["after"]
        print(
            f"blocks {blocks}: files read {b['live_files']} -> {a['live_files']}, on disk {b['data_files']} -> "
            f"{a['data_files']}, sql {b['sql_s']:.3f} -> {a['sql_s']:.3f} s (connect {b['connect_s']:.3f} -> "
            f"{a['connect_s']:.3f}), "
            f"time travel {b['time_travel_s']:.3f} -> {a['time_travel_s']:.3f} s ({a['time_travel_rows']} rows), "
            f"maintain {res['maintain_s']:.1f} s, MB {b['data_mb']:.1f} -> {a['data_mb']:.1f}, "
            f"vacuum without lineage would delete {res['vacuum_without_lineage_files']} files",
            flush=True,
        )
        results.append(res)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
