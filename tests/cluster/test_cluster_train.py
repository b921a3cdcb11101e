"""`rlake train` on a three-node Ray cluster where no node can read another's disk (issue #18).

Services are real and on 127.0.0.1: Postgres (Dagster's instance and MLflow's backend), SeaweedFS S3 (every
table and checkpoint, MLflow's artifacts), an MLflow server, and a Ray head plus two worker nodes, each in its
own mount namespace with a private /tmp (tests/cluster/ray_cluster.py). The driver runs on the head, as `ray job
submit` would run it, with its output_dir on the head's private /tmp; the trainer ranks are pinned to node a and
the rollout engine to node b by per-role resources, so every hand-off between driver, trainer and engine has to
go through the bucket or Ray's object store. Worker nodes get no S3 credentials from their own environment:
the run forwards them with ray.runtime_env.env_vars_from, by a setup hook, so that no node's Ray logs hold them.

The tests share one run and go in order: train 2 iterations, check where things landed, re-score iteration 1
from a second process through the Postgres instance, replay an update, then continue the run to 4 iterations
while first the trainer node and then the rollout node crash: it must finish by itself (issue #37).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

from tests.cluster.ray_cluster import RayCluster
from tests.servers import ACCESS_KEY, SECRET_KEY, start_mlflow, start_postgres, start_s3

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "cluster-run"
PREFIX = "cluster"
DRIVER_OUT = "/tmp/driver_out"  # on the head's private tmpfs: the driver's own disk
CACHE = "/tmp/rlake-cache"  # each node's private checkpoint cache
DAGSTER_YAML = """
storage:
  postgres:
    postgres_url:
      env: RLAKE_TEST_DAGSTER_PG_URL
telemetry:
  enabled: false
"""


class Env:
    def __init__(self, workdir: Path, *, log_requests: bool = False) -> None:
        """log_requests: the S3 and MLflow servers log each request with its time (tests/servers.py)."""
        self.pg = start_postgres(workdir / "pg")
        self.s3 = start_s3(workdir / "s3", log_requests=log_requests)
        self.mlflow = start_mlflow(
            workdir / "mlflow",
            self.pg.create_db("mlflow"),
            self.s3.root("mlartifacts"),
            self.s3.env,
            log_requests=log_requests,
        )
        self.dagster_pg = self.pg.create_db("dagster")
        self.cluster = RayCluster(workdir / "ray")
        self.cluster.start_head(num_cpus=0)
        self.cluster.add_node("a", 3, {"trainer_node": 1})  # 2 CPUs for the 2 trainer ranks, 1 for data tasks
        self.cluster.add_node("b", 2, {"rollout_node": 1})

    def overrides(self) -> list[str]:
        opts = json.dumps(self.s3.storage_options)
        return [
            f"ray.address={self.cluster.gcs_address}",
            "ray.num_cpus=null",
            "ray.runtime_env={env_vars_from: [AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY]}",
            "ray.resources_per_worker={actor: {CPU: 1, trainer_node: 0.5}, rollout: {CPU: 1, rollout_node: 1}}",
            "ray.data_min_rows=0",  # table stages on Ray Data whatever the size, as docs/cluster.md sets it
            f"storage.root={self.s3.root(PREFIX)}",
            f"storage.options={opts}",
            f"storage.cache_dir={CACHE}",
            "storage.cache_keep_versions=1",  # each node keeps version 0 and its newest version
            f"trainer.output_dir={DRIVER_OUT}",
            f"trainer.mlflow_tracking_uri={self.mlflow.url}",
            "trainer.test_freq=100",  # validation before the first and after the last iteration only
        ]

    def driver(self, *rlake_args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        """`rlake ...` on the head node (in its mount namespace), DAGSTER_HOME on Postgres."""
        cmd, env = self._driver_cmd(rlake_args)
        return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)

    def start_driver(self, log: Path, *rlake_args: str) -> subprocess.Popen:
        """driver() in the background, stdout and stderr to `log`."""
        cmd, env = self._driver_cmd(rlake_args)
        with open(log, "wb") as out:
            return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def _driver_cmd(self, rlake_args: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
        home = "/tmp/dagster_home"
        script = textwrap.dedent(f"""
            import os, pathlib, sys
            os.chdir({str(ROOT)!r})  # nsenter starts in / of the head's namespace
            home = pathlib.Path({home!r}); home.mkdir(parents=True, exist_ok=True)
            (home / "dagster.yaml").write_text({DAGSTER_YAML!r})
            from pipelines.cli import main
            sys.argv = ["rlake", *{list(rlake_args)!r}]
            sys.exit(main())
        """)
        env = {
            **os.environ,
            **self.cluster.env,
            **self.s3.env,
            "DAGSTER_HOME": home,
            "RLAKE_TEST_DAGSTER_PG_URL": self.dagster_pg,
        }
        head = self.cluster.node("head").proc.pid
        return ["nsenter", "-t", str(head), "-m", "--", sys.executable, "-c", script], env

    def table(self, name: str) -> DeltaTable:
        return DeltaTable(f"{self.s3.root(PREFIX)}/tables/{name}", storage_options={**self.s3.env})

    def stop(self) -> None:
        self.cluster.stop()
        self.mlflow.stop()
        self.s3.stop()
        self.pg.stop()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("cluster"))
    yield e
    e.stop()


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"rc {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def trained(env):
    proc = env.driver("train", "--config", "configs/ci_tiny.yaml", "--run-id", RUN_ID, *env.overrides())
    _ok(proc)
    return proc


def _commits(env, table: str) -> list[dict]:
    return [h for h in env.table(table).history() if h.get("rlake.run_id") == RUN_ID and h.get("rlake.stage") == table]


def test_scoring_ran_on_every_node_and_the_ranks_wrote_their_rows(env, trained):
    """Each iteration's scored_rollouts ran on Ray Data with its map and write tasks spread over both nodes that
    have CPUs (the head has none); old_logprobs' rows were written by the trainer rank on node a and the rollouts'
    by the rollout rank on node b, the step (on the head) only committed them. Each commit names the nodes whose
    tasks or ranks wrote its files (rlake.write_nodes)."""
    a, b = env.cluster.node("a").node_id, env.cluster.node("b").node_id
    nodes = {a: "a", b: "b"}

    def written(table: str) -> list[set[str]]:
        return [{nodes.get(n, n) for n in json.loads(c.get("rlake.write_nodes", "[]"))} for c in _commits(env, table)]

    assert written("scored_rollouts") == [{"a", "b"}] * 2, written("scored_rollouts")
    assert written("old_logprobs") == [{"a"}] * 2, written("old_logprobs")
    assert written("rollouts") == [{"b"}] * 2, written("rollouts")


def test_tables_and_checkpoints_live_in_the_bucket(env, trained):
    keys = env.s3.keys(PREFIX + "/")
    for table in ("prompts", "rollouts", "scored_rollouts", "advantages", "iteration_metrics", "checkpoints"):
        assert any(k.startswith(f"{PREFIX}/tables/{table}/_delta_log/") for k in keys), table
    manifests = sorted(
        k for k in keys if k.startswith(f"{PREFIX}/checkpoints/{RUN_ID}/") and k.endswith("MANIFEST.json")
    )
    versions = {k.split("/")[3] for k in manifests}
    assert {"policy_v0", "policy_v1", "policy_v2"} <= versions, manifests
    rows = env.table("checkpoints").to_pandas()
    assert set(rows[rows.kind == "policy"].version) >= {0, 1, 2}
    metrics = env.table("iteration_metrics").to_pandas()
    assert sorted({i for i in metrics[metrics.run_id == RUN_ID].iteration if i >= 0}) == [0, 1]


def test_trainer_and_rollout_ran_on_their_own_nodes(env, trained):
    placed = env.table("workers").to_pandas()
    placed = placed[placed.run_id == RUN_ID]
    actor = set(placed[placed.role == "actor"].node_id)
    rollout = set(placed[placed.role == "rollout"].node_id)
    assert actor == {env.cluster.node("a").node_id}, placed
    assert rollout == {env.cluster.node("b").node_id}, placed


def test_new_weights_reach_the_engine_through_the_object_store(env, trained):
    """Version 1 came from the trainer on node a to the engine on node b through Ray's object store; version 0
    (written by the set-up, no trainer yet) through the bucket and node b's cache."""
    rollouts = env.table("rollouts").to_pandas(partitions=[("run_id", "=", RUN_ID)])
    assert set(rollouts[rollouts.iteration == 0].engine_sync) <= {"build", "cached"}  # validation of v0 built it
    assert set(rollouts[rollouts.iteration == 1].engine_sync) == {"object_store"}


def test_no_node_keeps_anything_but_its_cache(env, trained):
    for name in ("a", "b"):
        files = env.cluster.node(name).local_files("/tmp")
        assert all(f.startswith("/rlake-cache/") for f in files), (name, files[:20])
    driver = env.cluster.node("head").local_files("/tmp/driver_out")
    assert not [f for f in driver if f.startswith(("/tables/", "/checkpoints/"))], driver[:20]
    # MLflow's artifacts went through the server into the bucket, not onto the driver's disk
    assert any(k.startswith("mlartifacts/") for k in env.s3.keys("mlartifacts/"))


def _node_files(node, under: str) -> list[Path]:
    base = Path(f"/proc/{node.proc.pid}/root{under}")
    return [p for p in base.rglob("*") if p.is_file()] if base.is_dir() else []


def test_no_node_log_holds_the_storage_credentials(env, trained):
    """env_vars_from's values reach the workers (they read the bucket) without entering any Ray log or record:
    every file of every node's Ray session dir (runtime_env_agent.log included), and the driver's logs."""
    files = [f for n in ("head", "a", "b") for f in _node_files(env.cluster.node(n), "/tmp/ray")]
    files += _node_files(env.cluster.node("head"), DRIVER_OUT)
    assert any(f.name == "runtime_env_agent.log" for f in files), "Ray's session dirs were not found"
    leaks = [str(f) for f in files for s in (SECRET_KEY, ACCESS_KEY) if s.encode() in f.read_bytes()]
    assert leaks == [], leaks


def test_lease_released_and_caches_pruned_and_driver_read_no_weights(env, trained):
    # the run's lease is in the bucket, released by the driver's clean exit
    leases = [k for k in env.s3.keys(f"{PREFIX}/leases/{RUN_ID}/") if k.endswith(".json")]
    record = json.loads(env.s3.client().get_object(Bucket=env.s3.bucket, Key=leases[-1])["Body"].read())
    assert record["released"] is True and record["run_id"] == RUN_ID, record
    # node caches: version 0 and the newest version per kind (cache_keep_versions=1); node a committed 1 and 2
    cached = {}
    for name in ("head", "a", "b"):
        index = _node_files(env.cluster.node(name), f"{CACHE}/.index")
        cached[name] = {(e["version"], e["dir"]) for e in (json.loads(p.read_text()) for p in index)}
    assert {v for v, _ in cached["a"]} == {0, 2} or {v for v, _ in cached["a"]} == {2}, cached
    # the driver (head) read tokenizers and fingerprints of versions 1 and 2 without their weights
    head_weights = [p for p in _node_files(env.cluster.node("head"), CACHE) if p.suffix in (".safetensors", ".pt")]
    later = {d for v, d in cached["head"] if v > 0}
    assert not [p for p in head_weights if any(d in str(p) for d in later)], (head_weights, cached["head"])


def test_rescore_from_a_second_process_through_postgres(env, trained):
    before = env.table("scored_rollouts").version()
    proc = env.driver(
        "rescore", "--run-id", RUN_ID, "--iteration", "1", "--config", "configs/ci_tiny.yaml",
        *env.overrides(), "reward.format_score=0.3",
    )  # fmt: skip
    _ok(proc)
    scored = env.table("scored_rollouts")
    assert scored.version() > before
    commit = next(h for h in scored.history() if h.get("rlake.iteration") == "1")
    upstream = json.loads(commit["rlake.upstream"])
    rollouts_v = [
        h["version"]
        for h in env.table("rollouts").history()
        if h.get("rlake.iteration") == "1" and h.get("rlake.run_id") == RUN_ID
    ]
    assert upstream["rollouts"] in rollouts_v
    # the Dagster run of the rescore is in Postgres, next to the training's
    check = subprocess.run(
        [sys.executable, "-c", "import dagster as dg; i = dg.DagsterInstance.get(); print(len(i.get_runs()))"],
        env={**os.environ, "DAGSTER_HOME": str(_home_for_test(env)), "RLAKE_TEST_DAGSTER_PG_URL": env.dagster_pg},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    assert int(check.stdout.strip().splitlines()[-1]) >= 3


def _home_for_test(env) -> Path:
    home = env.cluster.workdir / "dagster_home_view"
    home.mkdir(exist_ok=True)
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    return home


def test_replay_of_an_update_trained_on_another_node(env, trained):
    """The replayed update runs on node a (its scratch copy stays there); its weights come back through Ray and
    equal the committed policy_v2, fetched from the bucket."""
    proc = env.driver(
        "replay", "--run-id", RUN_ID, "--iteration", "1", "--config", "configs/ci_tiny.yaml", *env.overrides()
    )
    _ok(proc)
    assert "weights" in proc.stdout, proc.stdout[-3000:]


KEYS = {
    "prompts": ["iteration", "split", "prompt_id"],
    "prompt_batches": ["iteration", "gen_round", "position"],
    "rollouts": ["iteration", "rollout_id"],
    "scored_rollouts": ["iteration", "rollout_id"],
    "old_logprobs": ["iteration", "rollout_id"],
    "ref_logprobs": ["iteration", "rollout_id"],
    "advantages": ["iteration", "rollout_id"],
    "iteration_metrics": ["iteration", "metric"],
    "checkpoints": ["kind", "version"],
    "workers": ["iteration", "role", "rank"],
}
"""The key of one row of each table of a run: a re-run iteration must replace its rows, never add to them."""
PER_ITERATION = ("prompt_batches", "rollouts", "scored_rollouts", "advantages", "iteration_metrics", "workers")


def _wait_for(what: str, cond, proc: subprocess.Popen, log: Path, timeout: float = 600) -> float:
    """Poll cond() until true; the time it became true. The driver exiting first is a failure with its output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        assert proc.poll() is None, f"driver exited {proc.returncode} before {what}:\n{log.read_text()[-6000:]}"
        time.sleep(0.3)
    raise AssertionError(f"{what} not seen in {timeout:.0f} s:\n{log.read_text()[-6000:]}")


def _committed(env, table: str, it: int) -> bool:
    """Iteration `it` of RUN_ID has rows in `table` (the stage committed)."""
    try:
        ds = env.table(table).to_pyarrow_dataset(partitions=[("run_id", "=", RUN_ID), ("iteration", "=", str(it))])
    except Exception:  # TableNotFoundError, or a commit being written
        return False
    return ds.count_rows() > 0


def _lose_and_replace(env, lost: str, new: str, resource: str) -> float:
    """Crash node `lost` (SIGKILL of all its processes), then start node `new` with the role's resource: the
    capacity the rebuilt group gets. Returns when the kill happened."""
    t_kill = time.monotonic()
    env.cluster.node(lost).lose()
    print(f"{time.strftime('%H:%M:%S')} lost node {lost}")
    env.cluster.add_node(new, 2, {resource: 1})
    print(f"{time.strftime('%H:%M:%S')} node {new} up ({time.monotonic() - t_kill:.1f} s after the loss)")
    return t_kill


def test_run_survives_losing_the_trainer_node_then_the_rollout_node(env, trained, tmp_path):
    """Issue #37: one `rlake train` to iteration 4 loses the trainer node while iteration 2's trainer work runs,
    then the rollout node as iteration 3 starts generating; each time the stage fails fast, the workers are
    rebuilt on new capacity from the bucket's checkpoint and the run finishes by itself, with no resume."""
    log = tmp_path / "driver.log"
    t0 = time.monotonic()
    args = ("train", "--config", "configs/ci_tiny.yaml", "--run-id", RUN_ID, *env.overrides())
    proc = env.start_driver(log, *args, "trainer.total_training_steps=4")  # validation after iteration 3 too
    try:
        _wait_for("rollouts of iteration 2", lambda: _committed(env, "rollouts", 2), proc, log)
        kill_a = _lose_and_replace(env, "a", "a2", "trainer_node")
        done_2 = _wait_for("iteration 2 done", lambda: _committed(env, "iteration_metrics", 2), proc, log)
        _wait_for("prompt batch of iteration 3", lambda: _committed(env, "prompt_batches", 3), proc, log)
        kill_b = _lose_and_replace(env, "b", "c", "rollout_node")
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    end, out = time.monotonic(), log.read_text(errors="replace")
    print(f"trainer node lost -> iteration 2 done: {done_2 - kill_a:.1f} s; rollout node lost -> run done: "
          f"{end - kill_b:.1f} s; whole run {end - t0:.1f} s")  # fmt: skip
    _print_recovery(env, out)
    assert rc == 0, out[-6000:]
    _check_placed_on_new_nodes(env)
    _check_every_row_once(env, iterations=range(4))
    _check_mlflow_steps_once(env, steps=range(1, 5))


def _print_recovery(env, out: str) -> None:
    """What the driver said about the losses (its terminal, then its framework log's warnings with their times)."""
    words = ("lost", "resum", "placement", "retry")
    print("\n".join(line for line in out.splitlines() if any(w in line for w in words)))
    logs = sorted(_node_files(env.cluster.node("head"), f"{DRIVER_OUT}/logs"), key=lambda p: p.stat().st_mtime)
    text = logs[-1].read_text(errors="replace") if logs else ""
    print("\n".join(line[:300] for line in text.splitlines() if any(w in line for w in words)))


def test_no_capacity_fails_fast_and_exits_with_the_resume_command(env, trained):
    """The trainer node crashes and nothing replaces it: each attempt's placement group fails after
    ray.placement_timeout_s, the iteration is retried trainer.max_iteration_retries times, then `rlake train` exits
    with the command that resumes the run. (Its config differs in ray.* only: resume_allow_config_change.)"""
    env.cluster.node("a2").lose()
    t0 = time.monotonic()
    extra = ("ray.placement_timeout_s=5", "trainer.max_iteration_retries=1", "trainer.resume_allow_config_change=true")
    args = ("train", "--config", "configs/ci_tiny.yaml", "--run-id", RUN_ID, *env.overrides(), *extra)
    proc = env.driver(*args, "trainer.total_training_steps=5", timeout=600)
    took, out = time.monotonic() - t0, proc.stdout + proc.stderr
    print(f"no capacity: rlake train exited {proc.returncode} after {took:.1f} s")
    _print_recovery(env, out)
    assert proc.returncode == 1, out[-6000:]
    assert "iteration 4 lost a worker (PlacementTimeoutError: placement group rlake:cluster-run:actor" in out, out
    assert "was not placed within 5 s (ray.placement_timeout_s)" in out and "retry 1 of" in out, out[-6000:]
    resume = "lost a worker 2 times in a row (trainer.max_iteration_retries=1)"
    assert resume in out and f"rlake train --config <your config> --run-id {RUN_ID}" in out, out[-6000:]


def _check_placed_on_new_nodes(env) -> None:
    placed = env.table("workers").to_pandas(partitions=[("run_id", "=", RUN_ID)])
    node = {name: env.cluster.node(name).node_id for name in ("a", "a2", "c")}
    for role, it, want in (("actor", 1, "a"), ("actor", 2, "a2"), ("actor", 3, "a2"), ("rollout", 3, "c")):
        got = set(placed[(placed.role == role) & (placed.iteration == it)].node_id)
        assert got == {node[want]}, (role, it, want, placed[["iteration", "role", "rank", "node_ip", "node_id"]])


def _check_every_row_once(env, iterations: range) -> None:
    """Every table of the run holds each row once (its KEYS), and each iteration's rows are all there."""
    tables = {k.split("/")[2] for k in env.s3.keys(f"{PREFIX}/tables/") if "/_delta_log/" in k}
    assert set(PER_ITERATION) <= tables, tables
    for name in sorted(tables):
        df = env.table(name).to_pandas(partitions=[("run_id", "=", RUN_ID)])
        assert name in KEYS, f"table {name} has no row key in KEYS: add one, so its rows are checked too"
        key = KEYS[name]
        dup = df[df.duplicated(key, keep=False)]
        assert dup.empty, (name, key, dup[key].head(10))
        if name in PER_ITERATION:
            assert set(iterations) <= set(df.iteration), (name, sorted(set(df.iteration)))
    rollouts = env.table("rollouts").to_pandas(partitions=[("run_id", "=", RUN_ID)])
    assert rollouts.groupby("iteration").size().to_dict() == {i: 32 for i in iterations}  # 8 prompts x 4
    assert {it: set(g.policy_version) for it, g in rollouts.groupby("iteration")} == {i: {i} for i in iterations}
    ckpt = env.table("checkpoints").to_pandas(partitions=[("run_id", "=", RUN_ID)])
    assert sorted(ckpt[ckpt.kind == "policy"].version) == list(range(len(iterations) + 1)), ckpt


def _check_mlflow_steps_once(env, steps: range) -> None:
    """The MLflow run has one point per step of every metric: no iteration was logged twice."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env.mlflow.url)
    exp = client.get_experiment_by_name("rlake-ci")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`rlake.run_id` = '{RUN_ID}'")
    assert "actor/pg_loss" in run.data.metrics, sorted(run.data.metrics)
    for metric in sorted(run.data.metrics):
        points = [p.step for p in client.get_metric_history(run.info.run_id, metric)]
        assert len(points) == len(set(points)), (metric, sorted(points))
    assert sorted(p.step for p in client.get_metric_history(run.info.run_id, "actor/pg_loss")) == list(steps)
