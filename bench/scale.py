"""How the driver's memory and the per-iteration bookkeeping grow with a run (#36): a benchmark, not a test.

    python bench/scale.py --rollouts 1000,10000,100000 --tokens 256 --json out.json
    python bench/scale.py --iterations 10,100,1000 --json out.json

--rollouts: per size, one subprocess writes synthetic rollouts (groups of 8, ~tokens/2 prompt and ~tokens response
ids, log-probs, gsm8k `#### N` answers, half right) as a run's rollouts and old_logprobs partitions through the
store; a FRESH one (the Dagster step's process: the in_process executor runs every step in one) runs what the
scored_rollouts, advantages and iteration_metrics assets run (recorded-version read, stage function on a local Ray,
write with lineage, metadata) and reports its RSS after imports, each step's own peak RSS (the peak counter reset
when the step begins) and seconds per part; a third runs the iteration_metrics step alone (its footprint).
--iterations: grows a run's tables (tiny_cpu's GRPO DAG) one small partition per table per iteration (real writes
with lineage, MLflow metrics and dataset inputs), one run per N, and times iteration N's bookkeeping by call site
(--repeat k: k iterations from N on, the median of each number; the runs' iterations alternate), and the CPU
seconds of all the process's threads in it (steadier than wall time on a shared box).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from contextlib import contextmanager, nullcontext
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_ACCEPT_CLOUD_SDK_WARNING", "1")

import numpy as np
import pandas as pd
import pyarrow as pa
import ray

from assets.common import lineage, write_table
from assets.iteration_metrics import stage_timings
from assets.resources import _MLFLOW_RUNS, RolloutStoreResource, TrackerResource, resolve_run_config
from assets.scored_rollouts import SUMMARY, reward_metadata
from configs.schema import RunConfig
from stages.advantages import Upstream, stream_advantages
from stages.io import sql
from stages.io import store as delta
from stages.io.stage_exec import Partition
from stages.io.store import code_version
from stages.io.tables import SCHEMAS
from stages.io.tracking import delta_dataset_input
from stages.iteration_metrics import iteration_metrics
from stages.run.machine import cpu_description
from stages.run.resume import completed_iterations
from stages.scored_rollouts import score_partition, score_rollouts
from stages.scored_tokens import ScoredRollouts
from stages.workers.connect import ensure_ray_for

RUN = "scale"
GROUP = 8
STREAMED = ("scored_rollouts", "advantages")
"""The partitions the iteration_metrics step streams (stages/iteration_metrics.py iteration_metrics)."""
ADV_READS = ("scored_rollouts", "old_logprobs")
"""The partitions the advantages step streams (stages/advantages.py)."""


def peak_mb(now: bool = False) -> float:
    """This process's peak RSS in MB so far (ru_maxrss), or with `now` its RSS now."""
    return psutil.Process().memory_info().rss / 2**20 if now else resource.getrusage(resource.RUSAGE_SELF)[2] / 1024


def run_of(root: Path):
    """(configs/tiny_cpu.yaml for run RUN under `root`: GRPO, rule reward on 2 Ray tasks, local Ray; its tables)."""
    base = [f"trainer.output_dir={root}", f"trainer.run_id={RUN}", f"rollout.n={GROUP}", "data.max_response_length=512"]
    cfg = resolve_run_config("", str(ROOT / "configs" / "tiny_cpu.yaml"), base)
    return cfg, RolloutStoreResource(root=str(root / "tables"))


class Clock(dict):
    """Seconds of named parts (`with clock("reward.compute"):`); under --profile's tracemalloc also each part's
    traced peak MB and, after a `.compute`, the 6 source lines holding the most traced memory."""

    traced: dict = {}

    @contextmanager
    def __call__(self, key: str):
        t0 = time.perf_counter()
        tracemalloc.reset_peak()
        yield
        self[key] = self.get(key, 0.0) + time.perf_counter() - t0
        if tracemalloc.is_tracing():
            top = tracemalloc.take_snapshot().statistics("lineno")[:6] if key.endswith(".compute") else []
            self.traced[key] = [tracemalloc.get_traced_memory()[1] / 2**20, *(str(x) for x in top)]


def _ragged(lengths, values) -> list:
    return list(np.split(values, np.cumsum(lengths)[:-1]))


def synthetic(n: int, tokens: int, seed: int = 0):
    """(rollouts, old_logprobs) DataFrames of n synthetic gsm8k rollouts as the two stages hand them to the store."""
    rng = np.random.default_rng(seed)
    group = np.arange(n) // GROUP
    resp = rng.integers(tokens // 2, tokens * 3 // 2 + 1, n)
    prompt = rng.integers(tokens // 4, tokens * 3 // 4 + 1, n // GROUP + 1)[group]

    lp = _ragged(resp, -rng.exponential(0.5, resp.sum()).astype(np.float32))
    old = [x + rng.normal(0, 0.01, len(x)).astype(np.float32) for x in lp]
    answers = rng.integers(0, 1000, n // GROUP + 1)[group]  # half the responses say the right answer
    said = np.where(rng.random(n) < 0.5, answers, answers + 1)
    words = "the apples cost three dollars so she pays twelve in total and keeps the rest " * (tokens // 2)
    text = [f"{words[s : s + 4 * k]} #### {a}" for s, k, a in zip(rng.integers(0, 40, n), resp.tolist(), said.tolist())]
    rollouts = pd.DataFrame(
        {
            **{"rollout_id": np.arange(n), "prompt_id": group, "group_id": group, "sample_index": np.arange(n) % GROUP},
            **{"ground_truth": [str(a) for a in answers.tolist()], "engine_weights_fingerprint": "synthetic"},
            "prompt_text": [words[: 4 * k] for k in prompt.tolist()],
            "prompt_token_ids": _ragged(prompt, rng.integers(0, 49152, prompt.sum(), dtype=np.int32)),
            "response_token_ids": _ragged(resp, rng.integers(0, 49152, resp.sum(), dtype=np.int32)),
            **{"rollout_logprobs": lp, "response_text": text, "response_length": resp.astype(np.int32)},
        }
    ).assign(policy_version=0, data_source="openai/gsm8k", finish_reason="stop", engine="hf", engine_sync="build")
    gap = [np.abs(np.exp(a) - np.exp(b)) for a, b in zip(old, lp)]
    olds = pd.DataFrame({"rollout_id": np.arange(n), "policy_version": 0, "old_logprobs": old}).assign(
        rollout_probs_diff_max=[float(g.max()) for g in gap], rollout_probs_diff_mean=[float(g.mean()) for g in gap]
    )
    return rollouts, olds


def prepare(n: int, tokens: int, root: Path) -> dict:
    """The rollout and old_logprobs steps' share: build the rows, write both partitions through the store."""
    (cfg, store), clock = run_of(root), Clock()
    with clock("build"):
        rollouts, olds = synthetic(n, tokens)
    with clock("write rollouts"):
        v = write_table(store, cfg, "rollouts", rollouts, 0, policy_version=0, upstream={"prompt_batches": 0})
    with clock("write old_logprobs"):
        write_table(store, cfg, "old_logprobs", olds, 0, policy_version=0, upstream={"rollouts": v})
    return {"prepare_s": dict(clock), "prepare_peak_rss_mb": peak_mb()}


def recorded_at(store, table: str, it: int) -> int:
    """The version a materialization recorded (table_exists, commit_lineage), without reading rows."""
    uri = store.uri(table)
    delta.table_exists(uri)
    return max(c["version"] for c in delta.commit_lineage(uri, run_id=RUN, iteration=it))


def read_at_recorded(store, table: str, it: int):
    """read_recorded once a materialization recorded the version: table_exists, commit_lineage, read at it."""
    return store.read(table, RUN, it, version=recorded_at(store, table, it))


def reward_step(cfg: RunConfig, store, clock: Clock) -> None:
    """The scored_rollouts step as assets/scored_rollouts.py score_streaming runs it: the stage executor (streamed in
    this process, Ray Data from ray.data_min_rows rows), then the metadata from the SUMMARY columns."""
    with clock("reward.read"):  # the recorded version only: the executor reads the rows batch by batch
        up = {"rollouts": recorded_at(store, "rollouts", 0)}
    with clock("reward.compute+write"):
        run = score_partition(
            cfg.reward,
            store.uri("rollouts"),
            store.uri("scored_rollouts"),
            run_id=RUN,
            iteration=0,
            version=up["rollouts"],
            lineage=lambda s: lineage(cfg, stage="scored_rollouts", policy_version=0, upstream=up, duration_s=s),
            max_response_length=cfg.data.max_response_length,
            data_min_rows=cfg.ray.data_min_rows,
        )
    with clock("reward.metadata"):  # the asset's MaterializeResult
        reward_metadata(store.read("scored_rollouts", RUN, 0, version=run.version, columns=SUMMARY)[0])


def steps(root: Path) -> dict:
    """The scored_rollouts, advantages and iteration_metrics steps (assets/scored_rollouts.py, assets/advantages.py, assets/iteration_metrics.py) in one
    process, as the in_process executor runs them; seconds per part and the peak RSS after each step."""
    out = {"driver_baseline_rss_mb": peak_mb(now=True)}
    (cfg, store), clock, peaks = run_of(root), Clock(), {}
    with clock("ray_start (once per run)"):
        ensure_ray_for(cfg)
    with clock("reward task workers start (once per run)"):  # 16 rows: Ray's task workers start and import
        score_rollouts(synthetic(16, 8)[0], cfg.reward)  # the in-memory path (reward model, judge) only now

    def reward():
        reward_step(cfg, store, clock)

    def advantages():
        advantages_step(cfg, store, clock)

    def metrics():
        metrics_step(cfg, store, clock)

    overall = peak_mb()
    for name, step in (("reward", reward), ("advantages", advantages), ("metrics", metrics)):
        gc.collect()
        reset_peak()
        step()  # its DataFrames go when it returns, as an asset's do
        peaks[name] = peak_mb()  # this step's own peak (the counter was reset when it began)
        overall = max(overall, peaks[name])
    ray.shutdown()
    return out | {"driver_peak_rss_mb": overall, "step_peak_mb": peaks, "stage_s": dict(clock)}


def advantages_step(cfg: RunConfig, store, clock: Clock) -> None:
    """The advantages step as assets/advantages.py runs it: the recorded versions, the stage streamed
    (stages/advantages.py: scalar columns, dense tensors, the output written batch by batch), metadata."""
    with clock("advantages.read"):  # the recorded versions only: the stage streams the partitions
        scored, old = (Partition(store.uri(t), RUN, 0, recorded_at(store, t, 0)) for t in ADV_READS)
        scored = ScoredRollouts(scored, Partition(store.uri("rollouts"), RUN, 0, recorded_at(store, "rollouts", 0)))
    with clock("advantages.compute+write"):
        up = {"scored_rollouts": scored.version, "old_logprobs": old.version}
        meta = lineage(cfg, stage="advantages", policy_version=0, upstream=up, duration_s=0.0)
        run = stream_advantages(cfg, Upstream(scored, old=old), store.uri("advantages"), lineage=meta)
    with clock("advantages.metadata"):
        adv = run.summary
        adv["advantage"].abs().mean(), (adv["advantage"] == 0).mean(), adv["group_id"].nunique()


def metrics_step(cfg: RunConfig, store, clock: Clock) -> None:
    """The iteration_metrics step as assets/iteration_metrics.py runs it: the recorded versions, the two partitions streamed."""
    with clock("metrics.read"):  # the recorded versions only: the stage streams the two partitions
        scored, adv = (Partition(store.uri(t), RUN, 0, recorded_at(store, t, 0)) for t in STREAMED)
        scored = ScoredRollouts(scored, Partition(store.uri("rollouts"), RUN, 0, recorded_at(store, "rollouts", 0)))
    with clock("metrics.compute"):
        timings = stage_timings(store, RUN, 0)
        m = iteration_metrics(scored, adv, update_metrics={}, timings=timings)
    with clock("metrics.write"):
        rows = pd.DataFrame({"policy_version": 1, "metric": list(m), "value": list(m.values())})
        write_table(store, cfg, "iteration_metrics", rows, 0, policy_version=1, upstream={"advantages": 0})


def metrics_alone(root: Path) -> dict:
    """The iteration_metrics step alone in a fresh process, over the partitions the steps phase wrote: its peak RSS
    above the RSS it started with is the step's own footprint (in the steps phase the advantages step's leftovers
    hide it)."""
    (cfg, store), clock = run_of(root), Clock()
    start = peak_mb(now=True)
    reset_peak()
    metrics_step(cfg, store, clock)
    return {"metrics_alone_start_mb": start, "metrics_alone_peak_mb": peak_mb(), "metrics_alone_s": dict(clock)}


def reset_peak() -> None:
    """Reset this process's peak RSS (Linux: /proc/self/clear_refs 5 resets VmHWM and ru_maxrss to the RSS now),
    so the next step's peak is its own, not the largest of the steps before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_sizes(sizes: list[int], tokens: int, profile: bool) -> list[dict]:
    """Per size, the two phases in fresh subprocesses (peaks do not carry over)."""
    out = []
    for n in sizes:
        row = {"rollouts": n, "tokens": tokens}
        with tempfile.TemporaryDirectory(prefix="rlake-scale-") as tmp:
            for phase in PHASES:
                result = Path(tmp) / f"{phase}.json"
                cmd = [sys.executable, __file__, "--one-size", str(n), phase, tmp, str(result), "--tokens", str(tokens)]
                cmd += ["--profile"] if profile else []
                subprocess.run(cmd, check=True)
                row |= json.loads(result.read_text())
        out.append(row)
        print(f"rollouts={n}: driver peak {row['driver_peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    return out


PHASES = {"prepare": None, "steps": steps, "metrics": metrics_alone}
"""run_sizes' subprocesses per size, in order (prepare: its own function, it takes the size)."""


def md(head: list[str], rows: list[list]) -> str:
    """A Markdown table; floats as %.3g-ish: no decimals from 100, else 2 (3 under 0.1)."""

    def cell(c) -> str:
        return str(c) if not isinstance(c, float) else f"{c:.0f}" if c >= 100 else f"{c:.3f}" if c < 0.1 else f"{c:.2f}"

    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    return "\n".join([*lines, *("| " + " | ".join(cell(c) for c in r) + " |" for r in rows)])


STAGES = ("reward", "advantages", "metrics")


def rollouts_tables(rows: list[dict]) -> str:
    head = ["rollouts", "rollouts + old_logprobs writes: peak RSS MB (synthetic build included)"]
    head += ["driver RSS after imports MB", *(f"{s} step's own peak MB" for s in STAGES), "**driver peak RSS MB**"]
    mem = [[r["rollouts"], r["prepare_peak_rss_mb"], r["driver_baseline_rss_mb"]] for r in rows]
    mem = [m + [r["step_peak_mb"][s] for s in STAGES] + [r["driver_peak_rss_mb"]] for m, r in zip(mem, rows)]
    head += ["metrics step alone: RSS at start MB", "its peak MB"]
    mem = [m + [r["metrics_alone_start_mb"], r["metrics_alone_peak_mb"]] for m, r in zip(mem, rows)]
    parts = ["write rollouts", "write old_logprobs", *rows[0]["stage_s"]]
    secs = [[r["rollouts"], *(r["stage_s"].get(k, r["prepare_s"].get(k)) for k in parts)] for r in rows]
    return md(head, mem) + "\n\nseconds\n\n" + md(["rollouts", *parts], secs)


# fmt: off
ITER_TABLES = {  # the tiny_cpu GRPO DAG's tables in order, each with the tables its stage reads
    "prompt_batches": ("prompts",), "rollouts": ("prompt_batches",), "old_logprobs": ("rollouts",),
    "scored_rollouts": ("rollouts",), "advantages": ("scored_rollouts", "old_logprobs"),
    "checkpoints": ("advantages",), "iteration_metrics": ("scored_rollouts", "advantages", "checkpoints"), "workers": (),
}
# fmt: on
RECORDED_READS = ("prompts", "prompt_batches", "rollouts", "rollouts", "scored_rollouts", "old_logprobs")
RECORDED_READS += ("advantages", "scored_rollouts", "advantages")
"""The tables of one tiny_cpu iteration's 9 read_recorded / upstream_version calls, one lineage look-up each: in prompt_
batches, rollouts, old_logprobs, scored_rollouts, advantages x2, policy_checkpoint (no rows), iteration_metrics x2."""
LOGGED = ("prompt_batches", "rollouts", "old_logprobs", "scored_rollouts", "advantages", "iteration_metrics")  # MLflow


def small_frame(name: str, rows: int = 16):
    """`rows` rows of table `name` with a value in every column a stage fills (lists of 4, no structs)."""

    def value(t):
        if pa.types.is_struct(t) or pa.types.is_string(t):  # structs null; strings "x" (no reward extra keys)
            return None if pa.types.is_struct(t) else "x"
        if pa.types.is_list(t):
            return [] if pa.types.is_string(t.value_type) else [value(t.value_type)] * 4
        return False if pa.types.is_boolean(t) else 0.5 if pa.types.is_floating(t) else 1

    fields = [f for f in SCHEMAS[name] if f.name not in ("run_id", "iteration")]
    row = {f.name: value(f.type) for f in fields} | ({"split": "train"} if name == "prompts" else {})
    return pa.Table.from_pylist([row] * rows, schema=pa.schema(fields)).to_pandas()


def count_delta_calls() -> dict[str, int]:
    """Counts of the DeltaTable opens and history() calls made through stages.io.store from now on (its DeltaTable
    replaced by a counting subclass; run_iterations puts the original back)."""
    counts = {"opens": 0, "history": 0}

    class CountingTable(ORIGINAL_TABLE):
        def __init__(self, *a, **kw):
            counts["opens"] += 1
            super().__init__(*a, **kw)

    def history(self, *a, **kw):  # on the class itself: store.open_table's tables may predate the count
        counts["history"] += 1
        return ORIGINAL_HISTORY(self, *a, **kw)

    delta.DeltaTable, ORIGINAL_TABLE.history = CountingTable, history
    return counts


def stop_counting() -> None:
    """Put back what count_delta_calls replaced."""
    delta.DeltaTable, ORIGINAL_TABLE.history = ORIGINAL_TABLE, ORIGINAL_HISTORY


ORIGINAL_TABLE, ORIGINAL_HISTORY = delta.DeltaTable, delta.DeltaTable.history


def write_iteration(store, cfg: RunConfig, it: int, frames: dict, clock: Clock | None = None) -> dict:
    """One iteration's partitions of every table, in the DAG's order, each with its stage's lineage."""
    versions: dict[str, int] = {"prompts": 0}
    for table, reads in ITER_TABLES.items():
        with clock("8 writes") if clock is not None else nullcontext():
            up = {t: versions[t] for t in reads}
            versions[table] = write_table(store, cfg, table, frames[table], it, policy_version=it, upstream=up)
    return versions


def bookkeeping(store, tracker, cfg: RunConfig, it: int, frames: dict) -> dict:
    """Iteration `it`'s bookkeeping by call site (seconds), the Delta opens and history() calls, file counts."""
    clock, counts, cpu = Clock(), count_delta_calls(), time.process_time()
    versions = write_iteration(store, cfg, it, frames, clock)
    for table in RECORDED_READS:  # assets/common.py recorded_version: is the recorded version this partition's?
        with clock("recorded_version lineage x9"):
            delta.first_commit_of(store.uri(table), [versions[table]], RUN, -1 if table == "prompts" else it)
    with clock("partition reads x11"):
        for i, table in enumerate(RECORDED_READS):
            if i != 6:  # policy_checkpoint's upstream_version reads no rows
                store.read(table, RUN, -1 if table == "prompts" else it, version=versions[table])
        store.read("prompts", RUN, -1, columns=["split"])  # train_prompt_count (policy_checkpoint)
        store.read("checkpoints", RUN, it)  # record_checkpoint, then checkpoint_metrics
        store.read("checkpoints", RUN, it)
    with clock("stage_timings lineage x5"):
        stage_timings(store, RUN, it)
    with clock("mlflow run_for"):
        mlflow_id = tracker.run_for(RUN, cfg, step=it + 1)
    with clock("mlflow log_metrics"):
        tracker.log_metrics(mlflow_id, {f"m/{k}": float(k) for k in range(40)}, step=it + 1)
    with clock("log_iteration (iteration_lineage x7)"):
        tracker.log_iteration(
            mlflow_id, store.location, RUN, it, metrics_version=versions["iteration_metrics"], policy_version=it + 1
        )
    per_iteration, counts = sum(clock.values()), dict(counts)  # the opens of rlake sql and resume: not counted
    cpu = time.process_time() - cpu  # all threads' CPU (delta-rs's too): the box's other work does not count
    delta.forget_tables()  # a new process (a launch, a run launched from the UI) reads each table's checkpoint once
    with clock("first opens of the 9 tables in a new process (per launch / UI run)"):
        for table in ["prompts", *ITER_TABLES]:
            delta.open_table(store.uri(table))
    # a new process (a launch, a Dagster run of its own) searches MLflow once; the other runs' stay remembered
    _MLFLOW_RUNS.pop((tracker.tracking_uri, tracker.experiment_name, RUN))
    with clock("mlflow run_for, first in a process (per launch)"):
        tracker.run_for(RUN, cfg, step=it + 1)
    with clock("rlake sql query"):
        sql.query(store.location, "SELECT metric, avg(value) FROM iteration_metrics GROUP BY metric")
    with clock("resume scan (per launch)"):
        completed_iterations(store.uri("iteration_metrics"), RUN)
    files = {t: sum(1 for _ in (Path(store.root) / t).rglob("*.parquet")) for t in [*ITER_TABLES, "prompts"]}
    out = {"iteration": it, "per_iteration_s": per_iteration, "per_iteration_cpu_s": cpu, "calls_s": dict(clock)}
    return out | {**counts, "files": files}


class Lake:
    """One run's tables and MLflow store under their own directory, grown to `size` iterations (the 10-, 100- and
    1000-iteration runs are measured side by side, so the box's drift falls on all of them alike)."""

    def __init__(self, size: int, frames: dict):
        self.tmp = Path(tempfile.mkdtemp(prefix=f"rlake-scale-it{size}-"))
        self.cfg, self.store = run_of(self.tmp)
        uri, art = f"sqlite:///{self.tmp}/mlflow.db", str(self.tmp / "mlartifacts")
        self.tracker = TrackerResource(tracking_uri=uri, artifact_root=art)
        self.size, self.frames, self.rows = size, frames, []
        write_table(self.store, self.cfg, "prompts", small_frame("prompts", 64), -1, policy_version=None, upstream={})
        mlflow_id, client = self.tracker.run_for(RUN, self.cfg, step=0), self.tracker._client()
        t0 = time.perf_counter()
        for it in range(size):
            versions = write_iteration(self.store, self.cfg, it, frames)
            self.tracker.log_metrics(mlflow_id, {f"m/{k}": float(k) for k in range(40)}, step=it + 1)
            entries = [{"table": t, "uri": str(self.store.uri(t)), "version": versions[t]} for t in LOGGED]
            client.log_inputs(mlflow_id, datasets=[delta_dataset_input(e, it) for e in entries])
        self.grow_s = time.perf_counter() - t0
        self.next = size
        # First one untimed bookkeeping: the process's first reads, lineage walks and MLflow calls at this size pay
        # one-time costs (imports, caches) that are no iteration's.
        self.bookkeeping()
        stop_counting()

    def bookkeeping(self) -> dict:
        out = bookkeeping(self.store, self.tracker, self.cfg, self.next, self.frames)
        self.next += 1
        return out

    def sample(self) -> None:
        """One measured iteration. Before it, one untimed write_iteration opens again the copies the previous
        one's new-process part dropped (forget_tables)."""
        write_iteration(self.store, self.cfg, self.next, self.frames)
        self.next += 1
        self.rows.append(self.bookkeeping())
        stop_counting()

    def summary(self) -> dict:
        """Each number the median over the samples (the machine is shared: one sample is noise)."""
        rows, mid = self.rows, statistics.median
        calls = {k: mid(r["calls_s"][k] for r in rows) for k in rows[0]["calls_s"]}
        for r in rows:  # what rlake looks up and logs, less the tables' own commits (delta-rs's write path)
            r["less_writes_s"] = r["per_iteration_s"] - r["calls_s"]["8 writes"]
        keys = ("per_iteration_s", "less_writes_s", "per_iteration_cpu_s", "opens", "history")
        numbers = {k: mid(r[k] for r in rows) for k in keys}
        shutil.rmtree(self.tmp, ignore_errors=True)
        return {
            **rows[0],
            "iteration": self.size,
            **numbers,
            "calls_s": calls,
            "files": rows[-1]["files"],
            "samples": rows,
            "grow_s": self.grow_s,
        }


def run_iterations(counts: list[int], repeat: int = 1) -> list[dict]:
    """One run per count, each grown to it (tight loop of writes + MLflow inputs), then `repeat` measured
    iterations of each, in rounds: one of every run per round, the order reversed every other round. Measured one
    after the other (all of N = 10 first, then all of N = 1000), a ratio of two medians moved by 0.5 between runs
    of this benchmark on one box: its load changes over minutes."""
    frames = {t: small_frame(t) for t in ITER_TABLES}
    lakes = []
    for n in counts:
        lakes.append(Lake(n, frames))
        print(f"iteration {n}: grown in {lakes[-1].grow_s:.0f} s", file=sys.stderr, flush=True)
    for r in range(repeat):
        for lake in lakes if r % 2 == 0 else lakes[::-1]:
            lake.sample()
    out = [lake.summary() for lake in lakes]
    for row in out:
        print(f"iteration {row['iteration']}: {row['per_iteration_s']:.2f} s", file=sys.stderr, flush=True)
    return out


def iterations_table(rows: list[dict]) -> str:
    sites, first = list(rows[0]["calls_s"]), rows[0]
    head = ["iteration N", "**bookkeeping s / iteration**", f"x N={first['iteration']}", "less the 8 writes s"]
    head += [f"x N={first['iteration']}", "its CPU s", "Delta opens", "history() calls", *sites, "parquet files"]
    cells = [
        [r["iteration"], r["per_iteration_s"], r["per_iteration_s"] / first["per_iteration_s"], r["less_writes_s"]]
        + [r["less_writes_s"] / first["less_writes_s"], r["per_iteration_cpu_s"], r["opens"], r["history"]]
        for r in rows
    ]
    cells = [c + [r["calls_s"][s] for s in sites] + [sum(r["files"].values())] for c, r in zip(cells, rows)]
    files = [[t, *(r["files"][t] for r in rows)] for t in rows[0]["files"]]
    return md(head, cells) + "\n\n" + md(["table", *(f"parquet files at {r['iteration']}" for r in rows)], files)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", default="", help="comma-separated sizes, e.g. 1000,10000,100000")
    ap.add_argument("--tokens", type=int, default=256, help="mean response tokens (prompts: half)")
    ap.add_argument("--iterations", default="", help="comma-separated iteration counts, e.g. 10,100,1000")
    ap.add_argument("--repeat", type=int, default=1, help="--iterations: measured iterations per N (medians)")
    ap.add_argument("--json", default=None, help="also write the measurements here")
    ap.add_argument("--profile", action="store_true", help="cProfile + tracemalloc of the steps (slower)")
    ap.add_argument("--one-size", nargs=4, help=argparse.SUPPRESS)  # N, phase (prepare|steps), root, result file
    args = ap.parse_args()
    if args.one_size:  # a child of run_sizes
        n, phase, root, result = args.one_size
        if args.profile and phase == "steps":
            tracemalloc.start(4)
            prof = cProfile.Profile()
            out = prof.runcall(steps, Path(root)) | {"traced": Clock.traced}
            pstats.Stats(prof).sort_stats("cumulative").print_stats(r"stages|assets", 40)
        else:
            out = prepare(int(n), args.tokens, Path(root)) if phase == "prepare" else PHASES[phase](Path(root))
        Path(result).write_text(json.dumps(out))
        return 0
    report = {"commit": code_version(), "cpu": cpu_description(), "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    if args.rollouts:
        report["rollouts"] = run_sizes([int(x) for x in args.rollouts.split(",")], args.tokens, args.profile)
        print(rollouts_tables(report["rollouts"]))
    if args.iterations:
        report["iterations"] = run_iterations([int(x) for x in args.iterations.split(",")], args.repeat)
        print(iterations_table(report["iterations"]))
    print(f"\n{report['cpu']}, commit {report['commit']}, {report['date']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
