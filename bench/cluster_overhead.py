"""Cluster vs local iteration overhead on one box (issue #37 item 4): the same ci_tiny run, both ways.

    nice python bench/cluster_overhead.py --steps 4 --json /work/bench_cluster/overhead.json

(a) local: `rlake train` as a user runs it by default (local Ray, local Delta, sqlite MLflow, a fresh
    DAGSTER_HOME on sqlite), all under --workdir;
(b) cluster: docs/cluster.md's set-up as tests/cluster/test_cluster_train.py builds it (reused, not copied): a Ray
    head + 2 worker nodes on 127.0.0.1, each with a private /tmp, token auth, SeaweedFS S3 for tables and
    checkpoints, Postgres for Dagster and MLflow, an MLflow server; the driver runs on the head.
Both get the same overrides (total_training_steps, test_freq=100: validation before the first and after the last
iteration). Per iteration: wall = this iteration's Dagster run end - the previous one's end (its creation for
iteration 0), so launching the run counts; compute = timing_s/step + timing_s/testing from iteration_metrics (the
stages' own time and validation); overhead = wall - compute. Also per Dagster step: step wall - stage time, and
the run's wall outside its steps (Dagster's run machinery). Postgres sessions opened per iteration come from
pg_stat_database.sessions, sampled every 0.5 s. Iteration 0 starts the workers and is left out of the means.
The cluster's data lives under --workdir (not /tmp: every node hides /tmp behind its own tmpfs).

--count-requests: the cluster's S3 (SeaweedFS, glog level 2) and MLflow server (access log, epoch ms) log every
request with its time; each is counted in the iteration (and the Dagster step) whose window holds its time, so
the counts say how many round trips an iteration makes whatever the box's load. S3 requests are told apart by
method and kind (a LIST, a Delta log commit, _last_checkpoint, a Delta checkpoint, table data, a model
checkpoint, an MLflow artifact), MLflow requests by method and endpoint. The local run makes none (files and
sqlite). The extra logging costs CPU: compare timings of runs with the same flag.

--schedstat: the driver's main thread (where the in-process executor runs every step) is sampled every 10 ms
from /proc/PID/task/PID/schedstat (ns on a CPU, ns runnable but waiting for one); per Dagster step and iteration
its wall splits into CPU, run-queue wait (the box's other processes: on one box, the cluster's own servers and
nodes) and off-CPU (blocked: S3, HTTP, Postgres, Ray GCS, sleeps). Linux only.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIG = "configs/ci_tiny.yaml"
RUN_ID = "overhead"
SQLITE_HOME = "telemetry:\n  enabled: false\n"


def _timings(metrics, run_id: str, it: int) -> dict[str, float]:
    m = metrics[(metrics["run_id"] == run_id) & (metrics["iteration"] == it)]
    return {r.metric: float(r.value) for r in m.itertuples() if r.metric.startswith("timing_s/")}


def _sessions_at(samples: list[tuple[float, int]], t: float) -> int | None:
    """Postgres sessions counted by the last sample at or before t."""
    before = [n for ts, n in samples if ts <= t]
    return before[-1] if before else None


def per_iteration(
    instance, metrics, run_id: str, samples: list[tuple[float, int]] | None = None, sched: list | None = None
) -> list[dict]:
    """One row per iteration: wall, compute, overhead, the step breakdown, Postgres sessions opened, and with
    `sched` (SchedSampler's samples) the driver main thread's CPU / run-queue / off-CPU seconds per step."""
    import dagster as dg

    from bench.overhead import TIMING_OF_STEP, _step_walls

    runs = instance.get_runs(filters=dg.RunsFilter(tags={"rlake/run_id": run_id}))
    rows, prev_end = [], None
    for run in sorted(runs, key=lambda r: instance.get_run_record_by_id(r.run_id).create_timestamp):
        record = instance.get_run_record_by_id(run.run_id)
        partition = run.tags.get("dagster/partition/iteration")
        if partition is None or record.end_time is None:
            prev_end = record.end_time or prev_end
            continue  # the set-up run (partition: the run id alone)
        it = int(partition)
        start = prev_end if prev_end is not None else record.create_timestamp.timestamp()
        timing = _timings(metrics, run_id, it)
        compute = timing.get("timing_s/step", 0.0) + timing.get("timing_s/testing", 0.0)
        run_wall, steps = _step_walls(instance, run.run_id)
        asset = {s: w - timing.get(TIMING_OF_STEP.get(s, f"timing_s/{s}"), 0.0) for s, w in steps.items()}
        row = {
            "iteration": it,
            "window": [start, record.end_time],  # epoch s: for samples taken outside (py-spy, /proc)
            "wall_s": record.end_time - start,
            "compute_s": compute,
            "overhead_s": record.end_time - start - compute,
            "before_run_start_s": record.end_time - start - run_wall,  # launch + planned events + gap
            "run_outside_steps_s": run_wall - sum(steps.values()),  # Dagster's run machinery
            "step_minus_stage_s": asset,  # asset reads/writes, metadata, step events
        }
        if samples:
            a, b = _sessions_at(samples, start), _sessions_at(samples, record.end_time)
            row["pg_sessions"] = b - a if a is not None and b is not None else None
        if sched:
            spans = {"iteration": (start, record.end_time), **_step_spans(instance, run.run_id)}
            row["sched"] = {k: sched_split(sched, a, b) for k, (a, b) in spans.items()}
        rows.append(row)
        prev_end = record.end_time
    return rows


def _windows(instance, run_id: str) -> list[tuple[int, float, float, dict[str, tuple[float, float]]]]:
    """(iteration, window start, end, {step: (start, end)}) of each iteration run, as per_iteration delimits them."""
    import dagster as dg

    runs = instance.get_runs(filters=dg.RunsFilter(tags={"rlake/run_id": run_id}))
    out, prev_end = [], None
    for run in sorted(runs, key=lambda r: instance.get_run_record_by_id(r.run_id).create_timestamp):
        record = instance.get_run_record_by_id(run.run_id)
        partition = run.tags.get("dagster/partition/iteration")
        if partition is not None and record.end_time is not None:
            start = prev_end if prev_end is not None else record.create_timestamp.timestamp()
            out.append((int(partition), start, record.end_time, _step_spans(instance, run.run_id)))
        prev_end = record.end_time or prev_end
    return out


def _step_spans(instance, dagster_run_id: str) -> dict[str, tuple[float, float]]:
    """{asset step: (STEP_START, STEP_SUCCESS or STEP_FAILURE time)} of one Dagster run."""
    spans: dict[str, list[float]] = {}
    for entry in instance.all_logs(dagster_run_id):
        ev = entry.dagster_event
        if ev is not None and ev.event_type_value == "STEP_START":
            spans[ev.step_key] = [entry.timestamp, entry.timestamp]
        elif ev is not None and ev.event_type_value in ("STEP_SUCCESS", "STEP_FAILURE") and ev.step_key in spans:
            spans[ev.step_key][1] = entry.timestamp
    return {k: (a, b) for k, (a, b) in spans.items()}


def s3_kind(method: str, path: str) -> str:
    """What an S3 request touched: `GET list` (a listing: the key prefix is in the query, not logged), `GET
    log <table>` (a commit file), `GET last_checkpoint <table>`, ..., `PUT data <table>`, `GET model` ..."""
    parts = path.strip("/").split("/")
    if len(parts) == 1:
        return f"{method} list"
    if "mlartifacts" in parts:
        return f"{method} mlflow_artifact"
    if "tables" in parts and len(parts) > parts.index("tables") + 2:
        table, rest = parts[parts.index("tables") + 1], parts[parts.index("tables") + 2 :]
        if rest[0] != "_delta_log":
            return f"{method} data {table}"
        name = rest[-1]
        kind = "last_checkpoint" if name == "_last_checkpoint" else "log" if name.endswith(".json") else "checkpoint"
        return f"{method} {kind} {table}"
    return f"{method} model" if "checkpoints" in parts else f"{method} other"


def count_requests(windows, s3: list, mlflow: list) -> list[dict]:
    """Per iteration window: S3 and MLflow requests in all, per Dagster step, and by kind / endpoint."""
    from collections import Counter

    rows = []
    for it, start, end, steps in windows:
        row: dict = {
            "iteration": it,
            "s3": 0,
            "mlflow": 0,
            "by_step": {},
            "s3_by_kind": Counter(),
            "mlflow_by_path": Counter(),
        }
        for server, reqs in (("s3", s3), ("mlflow", mlflow)):
            for t, method, path, _ in reqs:
                if not start < t <= end:
                    continue
                row[server] += 1
                step = next((k for k, (a, b) in steps.items() if a <= t <= b), "outside steps")
                key = s3_kind(method, path) if server == "s3" else f"{method} {path}"
                at = row["by_step"].setdefault(step, {"s3": 0, "mlflow": 0, "kinds": Counter()})
                at[server] += 1
                at["kinds"][key] += 1
                row["s3_by_kind" if server == "s3" else "mlflow_by_path"][key] += 1
        rows.append(row)
    return rows


def requests_table(rows: list[dict]) -> str:
    """Markdown: mean requests per iteration (iterations >= 1), per Dagster step, S3 and MLflow."""
    later = [r for r in rows if r["iteration"] > 0] or rows
    steps = sorted({s for r in later for s in r["by_step"]})
    lines = ["| requests per iteration (mean, it >= 1) | S3 | MLflow |", "|---|---|---|"]
    for s in steps:
        vals = [statistics.fmean(r["by_step"].get(s, {}).get(k, 0) for r in later) for k in ("s3", "mlflow")]
        lines.append(f"| step {s} | {vals[0]:.1f} | {vals[1]:.1f} |")
    lines.append(f"| **all** | {_mean(later, 's3'):.1f} | {_mean(later, 'mlflow'):.1f} |")
    return "\n".join(lines)


class SessionSampler:
    """pg_stat_database.sessions summed over the dagster and mlflow databases, every 0.5 s, on one connection."""

    def __init__(self, pg) -> None:
        import psycopg2

        self.conn = psycopg2.connect(host="127.0.0.1", port=pg.port, user=pg.user, dbname="rlake_probe")
        self.conn.autocommit = True
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        with self.conn.cursor() as cur:
            while not self._stop.is_set():
                cur.execute(
                    "select coalesce(sum(sessions), 0) from pg_stat_database where datname in %s",
                    (("dagster", "mlflow"),),
                )
                self.samples.append((time.time(), int(cur.fetchone()[0])))
                self._stop.wait(0.5)

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join(timeout=5)
        self.conn.close()
        return self.samples


class SchedSampler:
    """(time, ns on a CPU, ns waiting for a CPU) of the driver's main thread every 10 ms: the driver is the child
    of this process running pipelines.cli (the cluster's: nsenter's, which execs it)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def _driver() -> int | None:
        for d in Path("/proc").iterdir():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == os.getpid() and b"pipelines.cli" in (d / "cmdline").read_bytes():
                    return int(d.name)
            except (OSError, ValueError, IndexError):
                continue
        return None

    def _loop(self) -> None:
        pid = None
        while not self._stop.is_set():
            pid = pid or self._driver()
            if pid is not None:
                try:
                    cpu, runq, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
                    self.samples.append((time.time(), int(cpu), int(runq)))
                except OSError:
                    pid = None  # ended
            self._stop.wait(0.01)

    def stop(self) -> list[tuple[float, int, int]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.samples


def sched_split(samples: list[tuple[float, int, int]], a: float, b: float) -> dict[str, float]:
    """Seconds of window (a, b] the driver's main thread spent on a CPU, waiting for one, and off CPU (blocked)."""
    times = [s[0] for s in samples]
    i, j = max(bisect.bisect_right(times, a) - 1, 0), max(bisect.bisect_right(times, b) - 1, 0)
    cpu, runq = (samples[j][1] - samples[i][1]) / 1e9, (samples[j][2] - samples[i][2]) / 1e9
    return {"cpu_s": cpu, "runq_s": runq, "off_cpu_s": (b - a) - cpu - runq}


def sched_table(local: dict, cluster: dict) -> str:
    """Markdown: the driver main thread's CPU / run-queue / off-CPU seconds per step, means over iterations >= 1."""
    lines = ["| driver main thread (mean, it >= 1) | local CPU / runq / off s | cluster CPU / runq / off s |"]
    lines.append("|---|---|---|")
    rows = [r for mode in (local, cluster) for r in mode["iterations"] if r["iteration"] > 0 and r.get("sched")]
    for step in sorted({k for r in rows for k in r["sched"]}):
        cells = []
        for mode in (local, cluster):
            v = [r["sched"][step] for r in mode["iterations"] if r["iteration"] > 0 and step in r.get("sched", {})]
            keys = ("cpu_s", "runq_s", "off_cpu_s")
            cells.append(" / ".join(f"{statistics.fmean(x[k] for x in v):.2f}" if v else "nan" for k in keys))
        lines.append(f"| {step} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _instance(home: Path):
    import dagster as dg

    return dg.DagsterInstance.from_config(str(home))


def run_local(workdir: Path, steps: int, extra: list[str], sched: bool = False) -> dict:
    from deltalake import DeltaTable

    out = workdir / "local"
    home = out / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(SQLITE_HOME)
    args = ["train", "--config", CONFIG, "--run-id", RUN_ID, f"trainer.output_dir={out}", *_common(steps), *extra]
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    t0, sampler = time.time(), SchedSampler() if sched else None
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True
    )
    total, samples = time.time() - t0, sampler.stop() if sampler else None
    _check(proc, "local")
    metrics = DeltaTable(str(out / "tables" / "iteration_metrics")).to_pandas()
    return {"total_s": total, "iterations": per_iteration(_instance(home), metrics, RUN_ID, sched=samples)}


def _common(steps: int) -> list[str]:
    return [f"trainer.total_training_steps={steps}", "trainer.test_freq=100"]


def _check(proc: subprocess.CompletedProcess, mode: str) -> None:
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def run_cluster(workdir: Path, steps: int, extra: list[str], count: bool = False, sched: bool = False) -> dict:
    from tests.cluster.test_cluster_train import DAGSTER_YAML, Env

    t0 = time.time()
    env = Env(workdir / "cluster", log_requests=count)
    setup = time.time() - t0
    try:
        home = workdir / "cluster" / "bench_dagster_home"  # this process's view of the driver's Postgres instance
        home.mkdir(parents=True, exist_ok=True)
        (home / "dagster.yaml").write_text(DAGSTER_YAML)
        os.environ["RLAKE_TEST_DAGSTER_PG_URL"] = env.dagster_pg
        sampler, scheds = SessionSampler(env.pg), SchedSampler() if sched else None
        t0 = time.time()
        proc = env.driver(
            "train", "--config", CONFIG, "--run-id", RUN_ID, *env.overrides(), *_common(steps), *extra, timeout=3000
        )
        total = time.time() - t0
        samples, sched_samples = sampler.stop(), scheds.stop() if scheds else None
        _check(proc, "cluster")
        metrics = env.table("iteration_metrics").to_pandas()
        rows = per_iteration(_instance(home), metrics, RUN_ID, samples, sched_samples)
        out = {"total_s": total, "setup_s": setup, "pg_sessions_total": samples[-1][1] - samples[0][1]}
        if count:
            out["requests"] = _requests(env, _instance(home))
        return {**out, "iterations": rows}
    finally:
        env.stop()


def _requests(env, instance) -> list[dict]:
    """count_requests of the run's iterations from the two servers' logs."""
    from tests.servers import parse_mlflow_requests, parse_s3_requests

    time.sleep(1.0)  # the servers' last log lines
    s3 = parse_s3_requests(env.s3.log, time.localtime().tm_year)
    return count_requests(_windows(instance, RUN_ID), s3, parse_mlflow_requests(env.mlflow.log))


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r["iteration"] > 0 and r.get(key) is not None]
    return statistics.fmean(vals) if vals else float("nan")


def table(local: dict, cluster: dict) -> str:
    """Markdown: per iteration both modes side by side, then the means over iterations >= 1 and the ratio."""
    head = (
        "| iteration | local wall s | local compute s | local overhead s | cluster wall s | cluster compute s "
        "| cluster overhead s | overhead ratio | cluster PG sessions |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    by_it = {r["iteration"]: r for r in cluster["iterations"]}
    for lr in local["iterations"]:
        cr = by_it.get(lr["iteration"], {})
        ratio = cr.get("overhead_s", float("nan")) / lr["overhead_s"] if lr["overhead_s"] else float("nan")
        lines.append(
            f"| {lr['iteration']} | {lr['wall_s']:.2f} | {lr['compute_s']:.2f} | {lr['overhead_s']:.2f} "
            f"| {cr.get('wall_s', float('nan')):.2f} | {cr.get('compute_s', float('nan')):.2f} "
            f"| {cr.get('overhead_s', float('nan')):.2f} | {ratio:.2f} | {cr.get('pg_sessions')} |"
        )
    lo, co = _mean(local["iterations"], "overhead_s"), _mean(cluster["iterations"], "overhead_s")
    lines.append(
        f"| **mean, it >= 1** | {_mean(local['iterations'], 'wall_s'):.2f} "
        f"| {_mean(local['iterations'], 'compute_s'):.2f} | {lo:.2f} | {_mean(cluster['iterations'], 'wall_s'):.2f} "
        f"| {_mean(cluster['iterations'], 'compute_s'):.2f} | {co:.2f} | **{co / lo:.2f}** "
        f"| {_mean(cluster['iterations'], 'pg_sessions'):.1f} |"
    )
    return "\n".join(lines)


def breakdown(local: dict, cluster: dict) -> str:
    """Markdown: where the overhead sits, means over iterations >= 1."""
    lines = ["| part of the overhead (mean, it >= 1) | local s | cluster s |", "|---|---|---|"]
    for key in ("before_run_start_s", "run_outside_steps_s"):
        lines.append(f"| {key} | {_mean(local['iterations'], key):.2f} | {_mean(cluster['iterations'], key):.2f} |")
    steps = sorted({s for r in local["iterations"] + cluster["iterations"] for s in r["step_minus_stage_s"]})
    for s in steps:
        vals = []
        for mode in (local, cluster):
            v = [r["step_minus_stage_s"].get(s) for r in mode["iterations"] if r["iteration"] > 0]
            v = [x for x in v if x is not None]
            vals.append(statistics.fmean(v) if v else float("nan"))
        lines.append(f"| step {s}: step wall - stage time | {vals[0]:.2f} | {vals[1]:.2f} |")
    return "\n".join(lines)


def _timed(fn, n: int) -> float:
    """Median seconds of n calls of fn (after one warm-up call)."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _delta_probes(uri: str, options: dict[str, str]) -> dict[str, float]:
    import pandas as pd
    from deltalake import DeltaTable, write_deltalake

    df = pd.DataFrame({"iteration": range(32), "value": [0.5] * 32})
    append = lambda: write_deltalake(uri, df, mode="append", storage_options=options)  # noqa: E731
    return {
        "delta append 32 rows": _timed(append, 5),
        "delta open + read": _timed(lambda: DeltaTable(uri, storage_options=options).to_pandas(), 5),
    }


def _mlflow_probes(tracking_uri: str) -> dict[str, float]:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.create_experiment(f"probe-{time.time_ns()}")
    run = client.create_run(exp).info.run_id
    metrics = [Metric(f"m{i}", 1.0, 0, 0) for i in range(50)]
    return {
        "mlflow log_batch 50 metrics": _timed(lambda: client.log_batch(run, metrics=metrics), 5),
        "mlflow get_run": _timed(lambda: client.get_run(run), 5),
    }


def _dagster_probes(home: Path) -> dict[str, float]:
    from pipelines.dagster_storage import pool_postgres_connections

    instance = _instance(home)
    pool_postgres_connections(instance)
    return {"dagster get_run_records(limit=5)": _timed(lambda: instance.get_run_records(limit=5), 20)}


def probes(workdir: Path) -> dict[str, dict[str, float]]:
    """The single round trips an iteration makes many of, local storage vs the cluster's services (no Ray)."""
    from tests.cluster.test_cluster_train import DAGSTER_YAML
    from tests.servers import start_mlflow, start_postgres, start_s3

    pg, s3 = start_postgres(workdir / "probe_pg"), start_s3(workdir / "probe_s3")
    mlflow = start_mlflow(workdir / "probe_mlflow", pg.create_db("mlflow"), s3.root("mlartifacts"), s3.env)
    try:
        local_home, pg_home = workdir / "probe_local_home", workdir / "probe_pg_home"
        for home, text in ((local_home, SQLITE_HOME), (pg_home, DAGSTER_YAML)):
            home.mkdir(parents=True, exist_ok=True)
            (home / "dagster.yaml").write_text(text)
        os.environ["RLAKE_TEST_DAGSTER_PG_URL"] = pg.create_db("dagster")
        from pipelines.dagster_storage import dagster_home

        os.environ["DAGSTER_HOME"] = str(local_home)
        dagster_home(str(workdir))  # adds rlake's pooled sqlite event log, as `rlake train` does
        local = {**_delta_probes(str(workdir / "probe_table"), {}), **_dagster_probes(local_home)}
        local.update(_mlflow_probes(f"sqlite:///{workdir / 'probe_mlflow.db'}"))
        options = {**s3.env}
        cluster = {**_delta_probes(f"{s3.root('probe')}/table", options), **_dagster_probes(pg_home)}
        cluster.update(_mlflow_probes(mlflow.url))
        return {"local": local, "cluster": cluster}
    finally:
        mlflow.stop()
        s3.stop()
        pg.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="iterations per run (iteration 0 is left out of means)")
    ap.add_argument("--workdir", default="/work/bench_cluster", help="not under /tmp (the nodes hide it)")
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--only", choices=["local", "cluster", "probes"], default=None)
    ap.add_argument("--probes", action="store_true", help="also time single storage/MLflow/Dagster round trips")
    ap.add_argument("--count-requests", action="store_true", help="count the cluster's S3 and MLflow requests")
    ap.add_argument("--schedstat", action="store_true", help="the driver main thread's CPU / run-queue / off-CPU")
    ap.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = ap.parse_args()
    if args.workdir == "/tmp" or args.workdir.startswith("/tmp/"):
        ap.error("--workdir under /tmp: every cluster node hides /tmp behind its own tmpfs")
    workdir = Path(args.workdir) / time.strftime("%Y%m%d-%H%M%S")
    res: dict = {"config": CONFIG, "steps": args.steps, "load_before": os.getloadavg()}
    if args.only in (None, "local"):
        res["local"] = run_local(workdir, args.steps, args.overrides, args.schedstat)
        res["load_between"] = os.getloadavg()
    if args.only in (None, "cluster"):
        res["cluster"] = run_cluster(workdir, args.steps, args.overrides, args.count_requests, args.schedstat)
    if args.probes or args.only == "probes":
        res["probes"] = probes(workdir)
    res["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    if "local" in res and "cluster" in res:
        print(table(res["local"], res["cluster"]) + "\n\n" + breakdown(res["local"], res["cluster"]))
        if args.schedstat:
            print("\n" + sched_table(res["local"], res["cluster"]))
    elif "probes" not in res:
        print(json.dumps(res, indent=1, default=str))
    if "requests" in res.get("cluster", {}):
        print("\n" + requests_table(res["cluster"]["requests"]))
    if "probes" in res:
        print("\n| round trip (median s) | local | cluster |\n|---|---|---|")
        for k, v in res["probes"]["local"].items():
            print(f"| {k} | {v:.4f} | {res['probes']['cluster'][k]:.4f} |")
    print(f"load average before/between/after: {res['load_before']} {res.get('load_between')} {res['load_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
