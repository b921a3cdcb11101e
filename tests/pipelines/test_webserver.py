"""The Dagster webserver on 127.0.0.1 serves rlake's graph; runs launched over its GraphQL API write Delta, and
re-materializing one asset of one partition writes one new version of that table only."""

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

from stages.io import store

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gql(port: int, query: str, variables: dict | None = None) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        method="POST",
        data=json.dumps({"query": query, "variables": variables or {}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = json.loads(resp.read())
    assert "errors" not in body, body
    return body["data"]


@pytest.fixture(scope="module")
def webserver(tmp_path_factory, ray_session):
    port = _free_port()
    tmp_path = tmp_path_factory.mktemp("webserver")
    home = tmp_path / "dagster_home"
    home.mkdir()
    # no daemon in this test: launch runs directly instead of queueing them for one
    # (and no "join the community" dialog over the pages, no telemetry)
    (home / "dagster.yaml").write_text(
        "run_coordinator:\n  module: dagster._core.run_coordinator\n"
        "  class: DefaultRunCoordinator\nnux:\n  enabled: false\n"
        "telemetry:\n  enabled: false\n"
    )
    out = tmp_path / "out"
    address = ray_session.get_runtime_context().gcs_address
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "RLAKE_CONFIG": str(ROOT / "configs" / "ci_tiny.yaml"),
        # runs launched by the webserver attach to this test's Ray cluster (0.1 s) instead of starting one (10 s)
        "RLAKE_OVERRIDES": f"trainer.output_dir={out};trainer.run_id=ui-run;ray.address={address}",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dagster_webserver",
            "-w",
            str(ROOT / "workspace.yaml"),
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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


def _launch(port: int, repo: dict, job: str, *, assets: list[str] | None = None, partition: str | None = None) -> str:
    """Launch a run of `job` (optionally only some of its assets, for one partition); returns the Dagster run id."""
    selector = {"repositoryLocationName": repo["location"]["name"], "repositoryName": repo["name"], "jobName": job}
    if assets:
        selector["assetSelection"] = [{"path": [a]} for a in assets]
    params = {"selector": selector, "runConfigData": {}}
    if partition is not None:
        params["executionMetadata"] = {"tags": [{"key": "dagster/partition", "value": partition}]}
    launched = _gql(
        port,
        """
        mutation($p: ExecutionParams!) { launchRun(executionParams: $p) {
          __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }""",
        {"p": params},
    )["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    return launched["run"]["runId"]


def _wait(port: int, run_id: str, timeout_s: float = 240) -> str:
    status = None
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status = _gql(port, "query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }", {"id": run_id})[
            "runOrError"
        ]["status"]
        if status in ("SUCCESS", "FAILURE", "CANCELED"):
            break
        time.sleep(1)
    return status


def test_graph_served_runs_launched_and_one_asset_of_one_partition_rematerialized_over_graphql(webserver) -> None:
    port, out = webserver
    nodes = _gql(port, "{ assetNodes { assetKey { path } } }")["assetNodes"]
    keys = {n["assetKey"]["path"][-1] for n in nodes}
    assert {"prompts", "rollouts", "scored_rollouts", "policy_checkpoint", "iteration_metrics"} <= keys
    repo = _gql(port, "{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name } } } } }")
    (node,) = repo["repositoriesOrError"]["nodes"]
    assert _wait(port, _launch(port, node, "rlake_setup_job")) == "SUCCESS"
    prompts = store.read_partition(str(out / "tables" / "prompts"), "ui-run", -1)
    assert (prompts["split"] == "val").sum() == 16
    assert (out / "checkpoints" / "ui-run" / "policy_v0" / "config.json").is_file()

    # iteration 0 up to its rewards, then re-score: scored_rollouts alone, partition 0
    added = _gql(
        port,
        """mutation($r: RepositorySelector!) { addDynamicPartition(repositorySelector: $r,
        partitionsDefName: "iteration", partitionKey: "0") { __typename } }""",
        {"r": {"repositoryLocationName": node["location"]["name"], "repositoryName": node["name"]}},
    )
    assert added["addDynamicPartition"]["__typename"] == "AddDynamicPartitionSuccess", added
    first = _launch(
        port, node, "rl_iteration_job", assets=["prompt_batches", "rollouts", "scored_rollouts"], partition="0"
    )
    assert _wait(port, first) == "SUCCESS"
    uri = {t: str(out / "tables" / t) for t in ("rollouts", "scored_rollouts")}
    rollouts_version, scored_before = store.table_version(uri["rollouts"]), store.table_version(uri["scored_rollouts"])
    old = store.read_partition(uri["scored_rollouts"], "ui-run", 0)

    rescore = _launch(port, node, "rl_iteration_job", assets=["scored_rollouts"], partition="0")
    assert _wait(port, rescore) == "SUCCESS"
    steps = _gql(
        port, "query($id: ID!) { runOrError(runId: $id) { ... on Run { stepKeysToExecute } } }", {"id": rescore}
    )["runOrError"]["stepKeysToExecute"]
    assert steps == ["scored_rollouts"]
    assert store.table_version(uri["rollouts"]) == rollouts_version  # nothing regenerated
    assert store.table_version(uri["scored_rollouts"]) == scored_before + 1
    newest, previous = store.commit_lineage(uri["scored_rollouts"], run_id="ui-run", iteration=0)
    assert newest["version"] == scored_before + 1 and newest["upstream"] == previous["upstream"] == {
        "rollouts": rollouts_version
    }
    assert newest["upstream_version_source"] == '{"rollouts": "dagster"}'
    new = store.read_partition(uri["scored_rollouts"], "ui-run", 0)
    assert len(new) == len(old) == 8 * 4  # replaced in place, not appended


def test_asset_graph_page_renders_in_headless_chromium(webserver, tmp_path) -> None:
    """The ROLLOUT group's asset graph (nodes, check and partition status) renders; screenshot kept in tmp_path."""
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install -y --no-install-recommends chromium; .ci/run does)")
    port, _ = webserver
    repo = _gql(port, "{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name } } } } }")
    (node,) = repo["repositoriesOrError"]["nodes"]
    url = f"http://127.0.0.1:{port}/locations/{node['name']}@{node['location']['name']}/asset-groups/ROLLOUT"
    args = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1600,1000",
        "--virtual-time-budget=20000",
    ]
    dom = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    for text in ("prompt_batches", "rollouts", "scored_rollouts", "Asset checks", "Partitions"):
        assert text in dom, f"the ROLLOUT asset graph page lacks '{text}'"
    assert "Join the Dagster community" not in dom
    shot = tmp_path / "asset_graph.png"
    subprocess.run([*args, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
    from PIL import Image

    with Image.open(shot) as img:
        assert img.size == (1600, 1000)
        colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # a rendered page, not a blank one
