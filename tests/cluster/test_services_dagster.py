"""Dagster on Postgres, as a team shares it: runs recorded by one process are seen by another, and stale-run
detection fails only runs whose driver is known gone (pipelines/runner.py).

The instance is a DAGSTER_HOME whose dagster.yaml says `storage: postgres: postgres_url: {env: VAR}` (the
form docs/cluster.md gives: the URL, and any password in it, come from the environment, never the file).
Every Dagster process here is a separate Python process started with `subprocess`, as `rlake train` on one
host and `rlake ui` on another would be; the Postgres server is tests/servers.py's, on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from pipelines.runner import DRIVER_PID_TAG, _fail_stale_runs, check_instance_yaml, dagster_home

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
URL_VAR = "RLAKE_TEST_DAGSTER_PG_URL"
HOME_YAML = f"storage:\n  postgres:\n    postgres_url:\n      env: {URL_VAR}\n"


@pytest.fixture
def pg_home(postgres_server, tmp_path: Path, request) -> tuple[Path, dict[str, str]]:
    """A fresh database and a DAGSTER_HOME on it; returns (home, the environment a process needs to use it)."""
    db = "dagster_" + request.node.name.split("[")[0].removeprefix("test_")[:40]
    url = postgres_server.create_db(db)
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(HOME_YAML)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        URL_VAR: url,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
    }
    with pytest.MonkeyPatch.context() as mp:  # create the schema once, as `dagster instance migrate` does
        mp.setenv(URL_VAR, url)
        dg.DagsterInstance.from_config(str(home)).dispose()
    return home, env


def _python(code: str, env: dict[str, str], timeout: float = 300) -> dict:
    """Run `code` in a new Python process; it prints one JSON line last, which is returned."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


MATERIALIZE_PROMPTS = """
    import json, os, sys
    import dagster as dg
    from assets.common import add_partitions
    from configs.errors import load_run_config
    from pipelines.definitions import build_definitions
    from pipelines.jobs import SETUP_JOB
    from pipelines.runner import dagster_home, launch_config, run_tags

    cfg = load_run_config("configs/ci_tiny.yaml", [f"trainer.output_dir={sys.argv[1]}"]).with_run_id("pg-run")
    dagster_home(cfg.trainer.output_dir)  # DAGSTER_HOME is set: the Postgres home, as `rlake train` finds it
    instance = dg.DagsterInstance.get()
    add_partitions(instance, cfg.run_id)
    job = build_definitions(cfg).resolve_job_def(SETUP_JOB)
    res = job.execute_in_process(
        instance=instance, tags=run_tags(cfg), run_config=launch_config(cfg), partition_key=cfg.run_id,
        asset_selection=[dg.AssetKey("prompts")],
    )
    print(json.dumps({"pid": os.getpid(), "run": res.run_id, "ok": res.success,
                      "storage": type(instance.run_storage).__name__}))
"""

READ_RUNS = """
    import json
    import dagster as dg

    instance = dg.DagsterInstance.get()
    runs = instance.get_runs(filters=dg.RunsFilter(tags={"rlake/run_id": "pg-run"}))
    mats = instance.fetch_materializations(dg.AssetKey("prompts"), limit=10).records
    print(json.dumps({
        "storage": [type(s).__name__ for s in (instance.run_storage, instance.event_log_storage)],
        "runs": [{"id": r.run_id, "status": r.status.value, "tags": dict(r.tags)} for r in runs],
        "materializations": [{"run": m.run_id, "partition": m.partition_key,
                              "rows": m.asset_materialization.metadata["rows"].value} for m in mats],
        "partitions": instance.get_dynamic_partitions("run"),
    }))
"""


def test_runs_rlake_records_in_postgres_are_seen_from_another_process(pg_home, tmp_path: Path) -> None:
    home, env = pg_home
    made = _python(MATERIALIZE_PROMPTS.replace("sys.argv[1]", repr(str(tmp_path / "out"))), env)
    assert made["ok"] and made["storage"] == "PostgresRunStorage", made

    seen = _python(READ_RUNS, env)  # another process, as `rlake ui` on another host: only the URL in common
    assert seen["storage"] == ["PostgresRunStorage", "PostgresEventLogStorage"]
    (run,) = seen["runs"]
    assert run["id"] == made["run"] and run["status"] == "SUCCESS"
    assert run["tags"][DRIVER_PID_TAG] == str(made["pid"]) and run["tags"]["dagster/partition"] == "pg-run"
    assert [(m["run"], m["partition"]) for m in seen["materializations"]] == [(made["run"], "pg-run")]
    assert seen["materializations"][0]["rows"] > 0
    assert "pg-run" in seen["partitions"]

    # the rows are in Postgres itself, and the home holds no sqlite store and no secret
    with sa.create_engine(env[URL_VAR]).connect() as conn:
        rows = conn.execute(sa.text("SELECT run_id, status FROM runs")).all()
    assert [(r.run_id, r.status) for r in rows] == [(made["run"], "SUCCESS")]
    assert not [p.name for p in home.rglob("*.db")]
    text = (home / "dagster.yaml").read_text()
    assert env[URL_VAR] not in text and "enabled: false" in text  # dagster_home appended telemetry: off


DRIVER = """
    import json, os, sys, time
    import dagster as dg

    kind = sys.argv[1]
    if kind == "launched":  # started by a run launcher (UI, sensor): no rlake driver recorded
        tags = {"rlake/run_id": "R", "rlake/driver": "sensor"}
    else:  # executed in-process by an rlake driver, as `rlake train` does
        from pipelines.runner import DRIVER_HOST_TAG, DRIVER_STARTED_TAG, driver_tags

        tags = {"rlake/run_id": "R", "rlake/driver": "cli", **driver_tags()}
        if kind == "remote":  # a driver on another node: its pid means nothing on this host
            tags[DRIVER_HOST_TAG] = "node-b.cluster.internal"
        if kind == "reused":  # the recorded driver started an hour earlier: this pid is another process now
            tags[DRIVER_STARTED_TAG] = f"{float(tags[DRIVER_STARTED_TAG]) - 3600:.2f}"

    @dg.op
    def train(context) -> None:
        print(json.dumps({"pid": os.getpid(), "run": context.run_id}), flush=True)
        time.sleep(600)  # killed by the test, or still alive when the stale check runs

    @dg.job(name=f"driver_{kind}")
    def driver():
        train()

    driver.execute_in_process(instance=dg.DagsterInstance.get(), tags=tags)
"""


def _spawn_driver(kind: str, env: dict[str, str], logs: Path) -> subprocess.Popen:
    """A process executing a Dagster run in-process (as `rlake train` does) that blocks in its one step."""
    with open(logs / f"{kind}.log", "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(DRIVER), kind],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )


def _wait_started(kind: str, proc: subprocess.Popen, logs: Path) -> tuple[subprocess.Popen, str]:
    """(the driver, its Dagster run id) once the run's step runs, i.e. the run is STARTED in Postgres."""
    line = proc.stdout.readline()
    assert line, (
        f"driver {kind} exited with {proc.wait()} before its run started:\n"
        + ((logs / f"{kind}.log").read_text()[-3000:])
    )
    info = json.loads(line)
    assert info["pid"] == proc.pid
    return proc, info["run"]


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL a driver by its process group (it was started in a session of its own)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _status(instance: dg.DagsterInstance, run_id: str) -> str:
    return instance.get_run_by_id(run_id).status.value


def test_stale_run_detection_fails_only_runs_whose_driver_is_gone(pg_home, monkeypatch, tmp_path: Path) -> None:
    home, env = pg_home
    monkeypatch.setenv(URL_VAR, env[URL_VAR])
    kinds = ("killed", "alive", "reused", "remote", "launched")
    procs = {kind: _spawn_driver(kind, env, tmp_path) for kind in kinds}  # started together: imports overlap
    drivers = {kind: _wait_started(kind, proc, tmp_path) for kind, proc in procs.items()}
    try:
        for kind in ("killed", "remote", "launched"):
            _kill(drivers[kind][0])  # SIGKILL: the process cannot mark its run; it stays STARTED
        instance = dg.DagsterInstance.from_config(str(home))  # this process: the resuming `rlake train`
        runs = {kind: run for kind, (_, run) in drivers.items()}
        assert {k: _status(instance, r) for k, r in runs.items()} == dict.fromkeys(runs, "STARTED")

        failed = _fail_stale_runs(instance, "R")

        assert sorted(failed) == sorted([runs["killed"][:8], runs["reused"][:8]])
        assert _status(instance, runs["killed"]) == "FAILURE"
        assert _status(instance, runs["reused"]) == "FAILURE"  # pid alive, but not the process that ran it
        assert _status(instance, runs["alive"]) == "STARTED"  # its driver still runs: never failed
        assert _status(instance, runs["remote"]) == "STARTED"  # another host's pid is not judged here
        assert _status(instance, runs["launched"]) == "STARTED"  # the default launcher has no health check
        (event,) = instance.all_logs(runs["killed"], of_type=dg.DagsterEventType.RUN_FAILURE)
        assert f"pid {drivers['killed'][0].pid}" in event.message and "has exited" in event.message

        _kill(drivers["alive"][0])
        assert _fail_stale_runs(instance, "R") == [runs["alive"][:8]]
        assert _fail_stale_runs(instance, "other-run") == []
    finally:
        for proc in procs.values():
            _kill(proc)


def test_dagster_home_refuses_a_password_in_the_file_and_a_driverless_postgres_db(tmp_path: Path) -> None:
    conf = tmp_path / "dagster.yaml"
    leaky = "storage:\n  postgres:\n    postgres_url: postgresql+psycopg2://rlake:hunter2@db:5432/dagster\n"
    with pytest.raises(ValueError, match=r"storage\.postgres\.postgres_url holds a password.*\{env: DAGSTER_PG_URL\}"):
        check_instance_yaml(conf, leaky)
    literal = "run_storage:\n  module: dagster_postgres\n  class: PostgresRunStorage\n  config:\n    postgres_db:\n"
    literal += "      username: rlake\n      password: hunter2\n      hostname: db\n      db_name: dagster\n"
    with pytest.raises(ValueError, match=r"run_storage\.config\.postgres_db\.password is written in the file"):
        check_instance_yaml(conf, literal)
    no_scheme = "storage:\n  postgres:\n    postgres_db:\n      username: rlake\n      password: {env: PW}\n"
    with pytest.raises(ValueError, match=r"add `scheme: postgresql\+psycopg2`"):
        check_instance_yaml(conf, no_scheme)
    with pytest.MonkeyPatch.context() as mp:  # the URL in the environment is checked for its driver too
        mp.setenv(URL_VAR, "postgresql://rlake@db:5432/dagster")
        with pytest.raises(ValueError, match=rf"the URL in \${URL_VAR}\) names no driver"):
            check_instance_yaml(conf, HOME_YAML)
        mp.setenv(URL_VAR, "postgresql+psycopg2://rlake:secret@db:5432/dagster")  # a password in the env is fine
        check_instance_yaml(conf, HOME_YAML)  # the documented form
    check_instance_yaml(conf, no_scheme + "      scheme: postgresql+psycopg2\n")
    check_instance_yaml(conf, "storage:\n  postgres:\n    postgres_url: postgresql+psycopg2://rlake@db/dagster\n")
    # through dagster_home, as `rlake train` / `rlake ui` call it: refused before Dagster connects
    conf.write_text(leaky)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DAGSTER_HOME", str(tmp_path))
        with pytest.raises(ValueError, match="holds a password"):
            dagster_home(str(tmp_path / "out"))
    assert conf.read_text() == leaky  # nothing appended to a refused file


COUNT_CONNECTIONS = """
    import json, time
    import dagster as dg
    from sqlalchemy import event
    from pipelines.dagster_storage import pool_postgres_connections

    def work(pooled):
        instance = dg.DagsterInstance.get()
        used = pool_postgres_connections(instance) if pooled else False
        opened = []
        for storage in (instance.run_storage, instance.event_log_storage):
            event.listen(storage._engine, "connect", lambda *_: opened.append(1))
        t = time.perf_counter()
        for i in range(20):  # the kind of calls an iteration makes: run records, materialization lookups
            instance.get_runs(limit=1)
            instance.fetch_materializations(dg.AssetKey(f"a{i}"), limit=1)
        return used, len(opened), (time.perf_counter() - t) / 40

    off, on = work(False), work(True)
    print(json.dumps({"unpooled": off, "pooled": on}))
"""


def test_rlake_train_keeps_its_postgres_connections_open(pg_home) -> None:
    # dagster-postgres opens a connection per statement batch (NullPool): 40 instance calls open about 40
    # connections. pool_postgres_connections (what `rlake train` calls on its instance) keeps them open: the same
    # 40 calls open at most one per storage engine (run storage + event log = 2).
    _, env = pg_home
    got = _python(COUNT_CONNECTIONS, env)
    used_off, opened_off, _ = got["unpooled"]
    used_on, opened_on, _ = got["pooled"]
    assert not used_off and used_on
    assert opened_off >= 40, got
    assert opened_on <= 2, got


COUNT_EVENT_CONNECTIONS = """
    import json
    import dagster as dg
    from sqlalchemy import event
    from pipelines.dagster_storage import pool_postgres_connections, remember_schema

    KEYS = [str(i) for i in range(8)]

    @dg.asset(partitions_def=dg.StaticPartitionsDefinition(KEYS))
    def part(context) -> dg.MaterializeResult:
        return dg.MaterializeResult(metadata={"p": context.partition_key})

    def work(remember):
        instance = dg.DagsterInstance.get()
        pool_postgres_connections(instance)
        if remember:
            remember_schema(instance)
        opened = []
        event.listen(instance.event_log_storage._engine, "connect", lambda *_: opened.append(1))
        for key in KEYS:
            assert dg.materialize([part], instance=instance, partition_key=key).success
        return len(opened)

    print(json.dumps({"pooled": work(False), "remembered": work(True)}))
"""


def test_asset_events_reuse_the_pooled_connection(pg_home) -> None:
    # dagster-postgres asks whether its asset tag table exists while it holds the connection of the event it
    # stores: with a pool of one, a new connection per asset event. remember_schema (`rlake train` on Postgres)
    # answers it from memory after the first time: 8 materializations open a few connections in all, not 8+.
    _, env = pg_home
    got = _python(COUNT_EVENT_CONNECTIONS, env)
    assert got["pooled"] >= 8, got
    assert got["remembered"] <= 3, got
