"""What a partition write costs as a table's history grows (#36 item 4): a benchmark, not a test.

    python bench/delta_commit_growth.py --commits 1000 --json out.json

One table (`rollouts`, 16 small rows per partition), grown through stages.io.store.write_partition one partition
per commit, as a run grows it, for each of:
- `stats`: the per-column min/max/null statistics delta-rs writes by default, and its checkpoint every 100
  commits (rlake's tables before 7a003e8);
- `row counts, checkpoint every 100`: delta.dataSkippingNumIndexedCols=0 (numRecords only), delta-rs's default
  checkpoint interval (rlake's tables from 7a003e8 to the change to 10);
- `row counts, checkpoint every 10`: store.TABLE_CONFIGURATION as it is.
At 10 commits and at --commits it times --writes more writes (median and min ms, wall and the process's CPU), and
the whole growth in between (mean ms per write). Then, on the grown table of the last kind, it writes a checkpoint
at the newest version and moves every older commit and checkpoint out of `_delta_log` (what log expiry would
delete; rlake never does it: the log is the lineage), opens the table anew and times the writes again: the part of
the growth that comes from the log's length.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scale import small_frame
from stages.io import store
from stages.run.machine import cpu_description

TABLE = "rollouts"


def timed_writes(uri: str, frame, first: int, count: int) -> dict:
    """`count` partition writes (iterations first, first + 1, ...): median/min wall ms, median CPU ms."""
    wall, cpu = [], []
    for i in range(count):
        t0, c0 = time.perf_counter(), time.process_time()
        store.write_partition(uri, TABLE, frame, run_id="g", iteration=first + i, lineage={})
        wall.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
    return {"median_ms": statistics.median(wall), "min_ms": min(wall), "cpu_median_ms": statistics.median(cpu)}


def grow(uri: str, frame, start: int, stop: int) -> None:
    for it in range(start, stop):
        store.write_partition(uri, TABLE, frame, run_id="g", iteration=it, lineage={})


def prune_log(uri: str) -> int:
    """A checkpoint at the newest version, then every older log entry moved to a sibling directory; the number of
    entries left in _delta_log."""
    table = store.open_table(uri)
    table.create_checkpoint()
    newest, log = table.version(), Path(uri) / "_delta_log"
    aside = Path(uri).parent / "log_aside"
    aside.mkdir()
    for entry in log.iterdir():
        if entry.name[:20].isdigit() and int(entry.name[:20]) < newest:
            entry.rename(aside / entry.name)
    store.forget_tables()
    return sum(1 for _ in log.iterdir())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commits", type=int, default=1000)
    ap.add_argument("--writes", type=int, default=25, help="timed writes per point")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    frame, rows = small_frame(TABLE), []
    configured = dict(store.TABLE_CONFIGURATION)
    every_100 = {k: v for k, v in configured.items() if k != "delta.checkpointInterval"}
    kinds = [
        ("stats", {k: v for k, v in every_100.items() if "dataSkipping" not in k}),
        ("row counts, checkpoint every 100", every_100),
        (f"row counts, checkpoint every {configured['delta.checkpointInterval']}", configured),
    ]
    for name, config in kinds:
        store.TABLE_CONFIGURATION.clear()
        store.TABLE_CONFIGURATION.update(config)
        tmp = Path(tempfile.mkdtemp(prefix="rlake-commit-growth-"))
        uri = str(tmp / TABLE)
        grow(uri, frame, 0, 10)
        rows.append({"tables": name, "commits": 10, **timed_writes(uri, frame, 10**6, args.writes)})
        t0 = time.perf_counter()
        grow(uri, frame, 10, args.commits)
        growth_ms = (time.perf_counter() - t0) * 1000 / max(1, args.commits - 10)
        row = timed_writes(uri, frame, 2 * 10**6, args.writes)
        rows.append({"tables": name, "commits": args.commits, **row, "growth_mean_ms": growth_ms})
        if config is configured:
            left = prune_log(uri)
            row = timed_writes(uri, frame, 3 * 10**6, args.writes)
            rows.append({"tables": f"{name}, log pruned to {left} entries", "commits": args.commits, **row})
        store.forget_tables()
        shutil.rmtree(tmp, ignore_errors=True)
    store.TABLE_CONFIGURATION.clear()
    store.TABLE_CONFIGURATION.update(configured)
    print("| tables | commits before | write ms, median | min | CPU ms, median | mean ms of the writes from 10 |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        grown = f"{r['growth_mean_ms']:.1f}" if "growth_mean_ms" in r else ""
        cells = f"{r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['cpu_median_ms']:.1f} | {grown}"
        print(f"| {r['tables']} | {r['commits']} | {cells} |")
    print(f"\n{cpu_description()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
