"""MLflow as a team's server: runs in Postgres, artifacts proxied by the server into the object store.

A real `mlflow server` on 127.0.0.1 with the Postgres fixture as backend store and the S3 fixture's bucket
as `--artifacts-destination` (the server alone holds the S3 credentials). rlake's tracker (pipelines.resources
tracker_for -> assets.resources.TrackerResource) logs a run the way an rlake run does: params and config.yaml
on first use, iteration metrics, validation samples (stages/io/tracking.py), an end status. The client process
has no AWS credentials at all: with a server, rlake must leave the artifact root to the server (no local
`file://` root), so everything goes over HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import sqlalchemy as sa
from mlflow.tracking import MlflowClient

from configs.schema import RunConfig
from pipelines.resources import tracker_for
from tests.servers import PostgresServer, S3Server, start_mlflow

pytestmark = pytest.mark.cluster

CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_S3_ENDPOINT_URL")


@pytest.fixture
def server(postgres_server: PostgresServer, s3_server: S3Server, tmp_path: Path) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 (tests/servers.py start_mlflow): Postgres backend, s3://<bucket>/mlartifacts
    as its proxied artifact store. The S3 credentials are in the server's environment only; its job runner
    (8 huey processes, unused here) is off."""
    env = {**s3_server.env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    server = start_mlflow(
        tmp_path / "server", postgres_server.create_db("mlflow_services"), s3_server.root("mlartifacts"), env
    )
    try:
        yield server.url
    finally:
        server.stop()


def test_tracker_logs_metrics_to_postgres_and_artifacts_to_the_bucket_through_the_server(
    server: str, postgres_server: PostgresServer, s3_server: S3Server, tmp_path: Path, monkeypatch
) -> None:
    for name in CREDENTIALS:  # this process is a host that can reach only the tracking server
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    cfg = RunConfig.model_validate(
        {"trainer": {"output_dir": str(out), "mlflow_tracking_uri": server, "project_name": "rlake-services"}}
    )
    tracker = tracker_for(cfg)
    assert tracker.tracking_uri == server and tracker.artifact_root is None  # the server decides

    mid = tracker.run_for("svc-run", cfg, step=1)  # params, config.yaml, git tags: as an rlake run's first use
    tracker.log_metrics(mid, {"actor/pg_loss": -0.125, "val-core/reward/mean@1": 0.75}, step=1)
    scored = {"greedy": pd.DataFrame({"prompt_text": ["1+1="], "response_text": ["2"], "reward": [1.0]})}
    tracker.log_iteration(mid, str(tmp_path / "no_tables"), "svc-run", 0, metrics_version=0, policy_version=1,
                          validation=scored)  # fmt: skip
    assert tracker.end_run("svc-run", "FINISHED") == mid

    client = MlflowClient(server)
    run = client.get_run(mid)
    assert run.info.status == "FINISHED" and run.data.tags["rlake.run_id"] == "svc-run"
    assert [(m.step, m.value) for m in client.get_metric_history(mid, "actor/pg_loss")] == [(1, -0.125)]
    exp = client.get_experiment_by_name("rlake-services")
    assert exp.artifact_location.startswith("mlflow-artifacts:"), exp.artifact_location  # the server's proxy
    samples = json.loads(Path(client.download_artifacts(mid, "samples/val_step_1.json", str(tmp_path))).read_text())
    assert samples["data"][0][:2] == ["1+1=", "2"]  # read back through the server

    # the backend store is Postgres: the metric row is in its `metrics` table
    with sa.create_engine(postgres_server.url("mlflow_services")).connect() as conn:
        rows = conn.execute(
            sa.text("SELECT key, value, step FROM metrics WHERE run_uuid = :r ORDER BY key"), {"r": mid}
        ).all()
    assert [tuple(r) for r in rows] == [
        ("actor/pg_loss", -0.125, 1),
        ("val-core/reward/mean_at_1", 0.75, 1),
    ]  # rlake writes @ as _at_

    # the artifacts are objects in the bucket, under the server's destination; nothing on this host
    keys = s3_server.keys("mlartifacts/")
    prefix = f"mlartifacts/{exp.experiment_id}/{mid}/artifacts/"
    assert {prefix + "config.yaml", prefix + "samples/val_step_1.json"} <= set(keys), keys
    assert not (out / "mlartifacts").exists() and not (Path.cwd() / "mlartifacts").exists()


def test_a_store_rlake_opens_itself_keeps_artifacts_beside_the_run(tmp_path: Path) -> None:
    """Without a server (the sqlite default), artifacts go to <trainer.output_dir>/mlartifacts as before."""
    cfg = RunConfig.model_validate({"trainer": {"output_dir": str(tmp_path / "out")}})
    tracker = tracker_for(cfg)
    assert tracker.tracking_uri == f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"
    assert tracker.artifact_root == (tmp_path / "out" / "mlartifacts").as_uri()
    https = RunConfig.model_validate({"trainer": {"mlflow_tracking_uri": "https://mlflow.example.org"}})
    assert tracker_for(https).artifact_root is None
