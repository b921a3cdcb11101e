"""rlake's Delta tables on a real S3 server (SeaweedFS on 127.0.0.1, tests/servers.py): partitions written and read
back, time travel, commit lineage, `rlake sql` / `lineage` / `plot`, the tracker's lineage walk and a worker's read
in another process, all through `storage.root=s3://...` + `storage.options`.

The environment holds only the credentials (as a cluster node's does); the endpoint, region and allow_http come
from storage.options, so a call that dropped the options would fail (checked). No commit may carry a secret."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from configs.errors import load_run_config
from pipelines.cli import main
from pipelines.rescore import scored_partition_version
from pipelines.resources import _rollout_store
from stages.io import dataset_io, sql, store, uris
from stages.io.checkpoints import ModelStore
from stages.io.plots import load_run_metrics
from stages.io.tables import SCHEMAS
from stages.io.tracking import iteration_lineage
from tests.servers import ACCESS_KEY, SECRET_KEY

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "ci_tiny.yaml")
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """A fresh prefix in the bucket; only the credentials in the environment; the run's config overrides."""
    for key, value in s3_server.env.items():
        if key in CREDENTIALS:
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)
    for key in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    prefix = f"storage-{uuid.uuid4().hex[:8]}"
    overrides = [
        f"storage.root={s3_server.root(prefix)}",
        f"storage.options={json.dumps(s3_server.storage_options)}",
        f"trainer.output_dir={tmp_path / 'out'}",
        "trainer.run_id=r1",
    ]
    return s3_server, prefix, overrides, load_run_config(CONFIG, overrides)


def _rollouts(n: int, seed: int) -> pd.DataFrame:
    """n rollouts of the real schema (stages/io/tables.py), distinct per seed."""
    base = {f.name: [None] * n for f in SCHEMAS["rollouts"] if f.name not in ("run_id", "iteration")}
    return pd.DataFrame(base).assign(
        policy_version=seed,
        rollout_id=range(n),
        prompt_id=[i // 2 for i in range(n)],
        group_id=[i // 2 for i in range(n)],
        sample_index=[i % 2 for i in range(n)],
        prompt_text=[f"{seed}+{i}=" for i in range(n)],
        prompt_token_ids=[[1, 2]] * n,
        response_token_ids=[[3, seed]] * n,
        response_text=[f"answer {seed}.{i}" for i in range(n)],
        response_length=2,
        is_baseline=False,
    )


def _metrics(values: dict[str, float], policy_version: int) -> pd.DataFrame:
    return pd.DataFrame({"policy_version": policy_version, "metric": list(values), "value": list(values.values())})


def _lineage(stage: str, upstream: dict[str, int]) -> dict:
    return {"stage": stage, "policy_version": "1", "config_hash": "cfg123", "upstream": upstream}


def _objects(server, prefix: str) -> dict[str, bytes]:
    s3 = server.client()
    return {k: s3.get_object(Bucket=server.bucket, Key=k)["Body"].read() for k in server.keys(prefix + "/")}


def test_partitions_round_trip_with_time_travel_and_lineage(s3) -> None:
    server, prefix, _, cfg = s3
    res = _rollout_store(cfg)
    assert res.root == f"s3://{server.bucket}/{prefix}/tables"
    v0 = res.write("rollouts", _rollouts(4, 0), run_id="r1", iteration=0, lineage=_lineage("rollouts", {"prompts": 0}))
    v1 = res.write("rollouts", _rollouts(2, 1), run_id="r1", iteration=1, lineage=_lineage("rollouts", {"prompts": 0}))
    v2 = res.write("rollouts", _rollouts(3, 7), run_id="r1", iteration=0, lineage=_lineage("rollouts", {"prompts": 1}))
    assert (v0, v1, v2) == (0, 1, 2)
    rows, read_v = res.read("rollouts", "r1", 0)
    assert read_v == 2 and sorted(rows["response_text"]) == ["answer 7.0", "answer 7.1", "answer 7.2"]
    assert res.read("rollouts", "r1", 1)[0]["response_token_ids"].map(list).tolist() == [[3, 1], [3, 1]]
    old, _ = res.read("rollouts", "r1", 0, version=v0)  # time travel to the first write of iteration 0
    assert sorted(old["response_text"]) == [f"answer 0.{i}" for i in range(4)]
    commits = res.lineage("rollouts", run_id="r1", iteration=0)
    assert [c["version"] for c in commits] == [2, 0] and [c["upstream"] for c in commits] == [
        {"prompts": 1},
        {"prompts": 0},
    ]
    assert {c["table"] for c in commits} == {"rollouts"} and commits[0]["config_hash"] == "cfg123"
    keys = server.keys(prefix + "/")
    assert f"{prefix}/tables/rollouts/_delta_log/00000000000000000002.json" in keys
    assert any(k.startswith(f"{prefix}/tables/rollouts/run_id=r1/iteration=1/") for k in keys)
    assert not (Path(cfg.trainer.output_dir) / "tables").exists()  # nothing on the local disk
    with pytest.raises(OSError):  # the endpoint is only in storage.options: a plain URI cannot reach the bucket
        store.table_exists(str(res.uri("rollouts")))


def test_no_credential_in_any_object_or_commit(s3) -> None:
    server, prefix, _, cfg = s3
    res = _rollout_store(cfg)
    for it in (0, 1):
        res.write("rollouts", _rollouts(2, it), run_id="r1", iteration=it, lineage=_lineage("rollouts", {"prompts": 0}))
    objects = _objects(server, prefix)
    logs = [k for k in objects if "/_delta_log/" in k]
    assert len(logs) >= 2
    for key, body in objects.items():
        assert SECRET_KEY.encode() not in body and ACCESS_KEY.encode() not in body, key
    for commit in store.commit_lineage(res.uri("rollouts")):
        assert SECRET_KEY not in json.dumps(commit, default=str) and ACCESS_KEY not in json.dumps(commit, default=str)
    assert not any(k.upper().startswith("AWS_SECRET") for k in res.storage_options)


def _tables_for_queries(res) -> None:
    res.write("rollouts", _rollouts(4, 0), run_id="r1", iteration=0, lineage=_lineage("rollouts", {"prompts": 0}))
    res.write("rollouts", _rollouts(2, 1), run_id="r1", iteration=1, lineage=_lineage("rollouts", {"prompts": 0}))
    for it, value in ((0, 0.25), (1, 0.75)):
        res.write(
            "iteration_metrics",
            _metrics({"critic/score/mean": value, "val-core/math/reward/mean@1": value / 2}, it + 1),
            run_id="r1",
            iteration=it,
            lineage=_lineage("iteration_metrics", {"rollouts": it, "advantages": 3}),
        )


def test_sql_query_and_cli_against_the_bucket(s3, capsys) -> None:
    server, prefix, overrides, cfg = s3
    res = _rollout_store(cfg)
    _tables_for_queries(res)
    q = "SELECT iteration, count(*) AS n FROM rollouts GROUP BY iteration ORDER BY iteration"
    assert sql.query(res.location, q).values.tolist() == [[0, 4], [1, 2]]
    plain_root = uris.tables_root(cfg)
    assert sql.query(plain_root, q, storage_options=res.storage_options)["n"].tolist() == [4, 2]
    assert sql.query(res.location, "SELECT count(*) AS n FROM rollouts", {"rollouts": 0})["n"].tolist() == [4]
    with pytest.raises(FileNotFoundError, match="no tables under 's3://"):
        sql.query(uris.join(res.location, "nothing-here"), "SELECT 1")

    assert main(["sql", "--config", CONFIG, "SELECT sum(value) AS s FROM iteration_metrics", *overrides]) == 0
    assert "1.5" in capsys.readouterr().out  # 0.25 + 0.125 + 0.75 + 0.375
    rc = main(["sql", "--config", CONFIG, "--version", "old:rollouts=0", "SELECT count(*) AS n FROM old", *overrides])
    assert rc == 0 and capsys.readouterr().out.split() == ["n", "4"]
    rc = main(["sql", "--tables", res.root, "--config", CONFIG, "SELECT count(*) AS n FROM rollouts", *overrides[1:2]])
    assert rc == 0 and capsys.readouterr().out.split() == ["n", "6"]

    assert main(["lineage", "iteration_metrics", *overrides, "--run-id", "r1", "--config", CONFIG]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["version"], e["iteration"], e["upstream"]) for e in entries] == [
        (1, "1", {"rollouts": 1, "advantages": 3}),
        (0, "0", {"rollouts": 0, "advantages": 3}),
    ]
    assert main(["lineage", "nosuchtable", *overrides]) == 2
    assert "no Delta table 'nosuchtable' at 's3://" in capsys.readouterr().err

    assert main(["plot", "r1", *overrides, "--config", CONFIG]) == 0
    assert (Path(cfg.trainer.output_dir).resolve() / "plots" / "r1.png").stat().st_size > 1000


def test_tracker_lineage_plots_and_rescore_lookup_on_s3(s3) -> None:
    _, _, _, cfg = s3
    res = _rollout_store(cfg)
    _tables_for_queries(res)
    entries = iteration_lineage(res.location, "r1", 1)  # what TrackerResource.log_iteration logs to MLflow
    assert [(e["table"], e["version"], e["uri"]) for e in entries] == [
        ("rollouts", 1, f"{res.root}/rollouts"),
        ("iteration_metrics", 1, f"{res.root}/iteration_metrics"),
    ]
    assert iteration_lineage(res.root, "r1", 1, storage_options=res.storage_options) == entries
    metrics = load_run_metrics(res.location, "r1")
    assert metrics["value"].tolist() == [0.25, 0.125, 0.75, 0.375]
    res.write(
        "scored_rollouts", _scored(), run_id="r1", iteration=0, lineage=_lineage("scored_rollouts", {"rollouts": 0})
    )
    assert scored_partition_version(res.location, "r1", 0) == 0
    with pytest.raises(LookupError, match="runs there: \\['r1'\\]"):
        scored_partition_version(res.location, "r1", 5)


def _scored() -> pd.DataFrame:
    df = _rollouts(2, 0)
    extra = [
        f for f in SCHEMAS["scored_rollouts"] if f.name not in df.columns and f.name not in ("run_id", "iteration")
    ]
    return df.assign(**{f.name: [0.5 if pa.types.is_floating(f.type) else None] * 2 for f in extra})


def test_a_worker_in_another_process_reads_with_the_options_it_was_handed(s3) -> None:
    """What the policy update does: its request carries rollout_store.uri(...) to a worker process (pickled)."""
    _, _, _, cfg = s3
    res = _rollout_store(cfg)
    res.write("rollouts", _rollouts(2, 3), run_id="r1", iteration=0, lineage=_lineage("rollouts", {}))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = pool.submit(store.read_partition, res.uri("rollouts"), "r1", 0).result(timeout=120)
    assert sorted(rows["response_text"]) == ["answer 3.0", "answer 3.1"]


def test_export_fetches_a_committed_checkpoint_from_the_bucket(s3, tiny_checkpoint, tmp_path, capsys) -> None:
    """`rlake export --run-id R --version N storage.root=s3://...`: the checkpoint comes from the bucket."""
    server, prefix, overrides, cfg = s3
    cache = tmp_path / "cache"
    overrides = [*overrides, f"storage.cache_dir={cache}"]
    cfg = load_run_config(CONFIG, overrides)
    with ModelStore.for_config(cfg, "R").writer("policy", 3) as staged:
        shutil.copytree(tiny_checkpoint, staged.dir, dirs_exist_ok=True)
    assert any(k.endswith("policy_v3/MANIFEST.json") for k in server.keys(f"{prefix}/checkpoints/"))
    shutil.rmtree(cache)  # as on another node: nothing cached, the export downloads it
    out = tmp_path / "hf"
    assert main(["export", "--run-id", "R", "--version", "3", "--out", str(out), "--config", CONFIG, *overrides]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["architecture"] == "Qwen2ForCausalLM" and (out / "model.safetensors").is_file()
    assert main(["export", "--run-id", "R", "--version", "4", "--out", str(tmp_path / "x"), *overrides]) == 2
    assert "needs policy version 4" in capsys.readouterr().err


def test_an_absent_table_is_listed_once_in_a_pinned_scope(s3, monkeypatch) -> None:
    """iteration_metrics asks table_exists about the tables the run never writes several times an iteration: in
    its pinned() scope a remote table found absent costs one LIST, and a write that creates it is seen."""
    _, _, _, cfg = s3
    res = _rollout_store(cfg)
    listed, real = [], store.DeltaTable.is_deltatable
    monkeypatch.setattr(store.DeltaTable, "is_deltatable", lambda *a, **kw: listed.append(a[0]) or real(*a, **kw))
    uri = res.uri("iteration_metrics")
    with store.pinned():
        assert not store.table_exists(uri) and not store.table_exists(uri) and len(listed) == 1
        res.write("iteration_metrics", _metrics({"m": 1.0}, 1), run_id="r1", iteration=0, lineage=_lineage("m", {}))
        assert store.table_exists(uri) and res.read("iteration_metrics", "r1", 0)[0]["value"].tolist() == [1.0]
    absent = res.uri("values")
    assert not store.table_exists(absent) and not store.table_exists(absent)  # outside a scope: a LIST each
    assert len(listed) == 4  # 1 + write_partition looking again before it created the table + 2


def _other_writer(res, table: str, rows: pd.DataFrame, iteration: int) -> None:
    """Another process's write of partition (r1, iteration): its own DeltaTable, not this process's open copy."""
    path, opts = store._open(res.uri(table), None)
    data = store.to_arrow(table, rows.assign(run_id="r1", iteration=iteration))
    predicate = f"run_id = 'r1' AND iteration = {iteration}"
    store.write_deltalake(store.DeltaTable(path, storage_options=opts), data, mode="overwrite", predicate=predicate)


def test_a_remote_write_skips_the_refresh_and_a_conflict_makes_it_again(s3, monkeypatch) -> None:
    """A remote table's open copy writes without being brought up to date first (a LIST and a GET fewer): another
    writer's commit to another partition is kept, and one to the same partition fails delta-rs's commit, which
    is then made again from the up-to-date copy (last writer wins), for both write paths."""
    _, _, _, cfg = s3
    res = _rollout_store(cfg)
    refreshed, real = [], store.DeltaTable.update_incremental
    monkeypatch.setattr(store.DeltaTable, "update_incremental", lambda t, *a: refreshed.append(t) or real(t, *a))
    res.write("iteration_metrics", _metrics({"m": 1.0}, 0), run_id="r1", iteration=0, lineage=_lineage("m", {}))
    _other_writer(res, "iteration_metrics", _metrics({"m": 2.0}, 1), 1)  # version 1: another partition
    refreshed.clear()
    v = res.write("iteration_metrics", _metrics({"m": 3.0}, 2), run_id="r1", iteration=2, lineage=_lineage("m", {}))
    assert (v, refreshed) == (2, [])  # committed after the other writer's version, without a refresh

    _other_writer(res, "iteration_metrics", _metrics({"m": 4.0}, 0), 0)  # version 3: the partition written next
    v = res.write("iteration_metrics", _metrics({"m": 5.0}, 0), run_id="r1", iteration=0, lineage=_lineage("m", {}))
    assert v == 4 and len(refreshed) == 1  # one failed commit, one refresh, the write made again
    assert {it: res.read("iteration_metrics", "r1", it)[0]["value"].tolist() for it in (0, 1, 2)} == {
        0: [5.0],
        1: [2.0],
        2: [3.0],
    }

    # the stage path: files the workers wrote, ONE commit of them (stages/io/dataset_io.commit_files); a Delta
    # transaction does not advance the copy, so it is brought up to date after it as well as after the conflict
    uri, refreshed[:] = res.uri("iteration_metrics"), []
    _other_writer(res, "iteration_metrics", _metrics({"m": 6.0}, 1), 1)  # version 5
    opts = uris.options_of(uri, None)
    files = dataset_io.write_block(
        _metrics({"m": 7.0}, 1), uri=uris.target(uri), options=opts, name="iteration_metrics", run_id="r1", iteration=1
    )
    v = dataset_io.commit_files(
        uri, "iteration_metrics", files, run_id="r1", iteration=1, lineage=_lineage("m", {}), storage_options=None
    )
    assert v == 6 and len(refreshed) == 2 and res.read("iteration_metrics", "r1", 1)[0]["value"].tolist() == [7.0]
    assert [c["version"] for c in res.lineage("iteration_metrics", run_id="r1", iteration=1)] == [6]
