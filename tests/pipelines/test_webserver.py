"""The Dagster webserver on 127.0.0.1 serves rlake's graph, and a run launched over GraphQL writes Delta."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from stages import store

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gql(port: int, query: str, variables: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", method="POST",
                                 data=json.dumps({"query": query, "variables": variables or {}}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = json.loads(resp.read())
    assert "errors" not in body, body
    return body["data"]


@pytest.fixture()
def webserver(tmp_path):
    port = _free_port()
    home = tmp_path / "dagster_home"
    home.mkdir()
    # no daemon in this test: launch runs directly instead of queueing them for one
    (home / "dagster.yaml").write_text("run_coordinator:\n  module: dagster._core.run_coordinator\n"
                                       "  class: DefaultRunCoordinator\n")
    out = tmp_path / "out"
    env = {**os.environ, "DAGSTER_HOME": str(home), "RLAKE_CONFIG": str(ROOT / "configs" / "ci_tiny.yaml"),
           "RLAKE_OVERRIDES": f"trainer.output_dir={out};trainer.run_id=ui-run"}
    proc = subprocess.Popen([sys.executable, "-m", "dagster_webserver", "-w", str(ROOT / "workspace.yaml"),
                             "-h", "127.0.0.1", "-p", str(port)], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            raise TimeoutError("webserver did not come up in 120 s")
        yield port, out
    finally:  # the webserver may ignore SIGTERM: stop the whole group, escalate to SIGKILL
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=15)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


def test_graph_served_and_setup_run_launched_over_graphql(webserver) -> None:
    port, out = webserver
    nodes = _gql(port, "{ assetNodes { assetKey { path } } }")["assetNodes"]
    keys = {n["assetKey"]["path"][-1] for n in nodes}
    assert {"prompts", "rollouts", "scored_rollouts", "policy_checkpoint", "iteration_metrics"} <= keys
    repo = _gql(port, "{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name } } } } }")
    (node,) = repo["repositoriesOrError"]["nodes"]
    launched = _gql(port, """
        mutation($p: ExecutionParams!) { launchRun(executionParams: $p) {
          __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }""",
        {"p": {"selector": {"repositoryLocationName": node["location"]["name"], "repositoryName": node["name"],
                            "jobName": "rlake_setup_job"}, "runConfigData": {}}})["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]
    status = None
    deadline = time.time() + 240
    while time.time() < deadline:
        status = _gql(port, "query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }",
                      {"id": run_id})["runOrError"]["status"]
        if status in ("SUCCESS", "FAILURE", "CANCELED"):
            break
        time.sleep(2)
    assert status == "SUCCESS"
    prompts = store.read_partition(str(out / "tables" / "prompts"), "ui-run", -1)
    assert (prompts["split"] == "val").sum() == 16
    assert (out / "checkpoints" / "ui-run" / "policy_v0" / "config.json").is_file()
